"""Hugging Face Trainer on zeropp: a tiny GPT-2 built from its config (no hub)
learns to count (a synthetic next-token task) with `TrainingArguments(deepspeed=...)`.
The one added line is `zeropp.install_as_deepspeed()`, before transformers.

    torchrun --nproc-per-node 2 examples/hf/trainer_lm.py --out runs/hf_trainer
    torchrun --nproc-per-node 2 examples/hf/trainer_lm.py --out runs/hf_trainer --resume
"""

import zeropp

zeropp.install_as_deepspeed()  # the one added line: Trainer's DeepSpeed path runs on zeropp

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402
from tiny import Counting, finish, tiny_gpt2, with_node_size  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto",
                                                      "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto",
                                                      "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                          "zero_hpz_partition_size": 2, "zero_quantized_gradients": True,
                          "stage3_gather_16bit_weights_on_model_save": True},
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/hf_trainer")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--ds-config", default=None, help="a ds_config.json (default: the dict above)")
    p.add_argument("--node-size", type=int, default=None, help="zeropp: ranks per node")
    p.add_argument("--from-pretrained", default=None, metavar="PATH",
                   help="load the model with from_pretrained after TrainingArguments: under "
                   "ZeRO-3, partitioned from construction")
    p.add_argument("--torch-compile", nargs="?", const="inductor", default=None,
                   metavar="BACKEND", help="TrainingArguments(torch_compile=True), with this "
                   "torch_compile_backend (default inductor)")
    a = p.parse_args()
    ds = json.load(open(a.ds_config)) if a.ds_config else with_node_size(DS_CONFIG, a.node_size)
    torch.manual_seed(0)
    model = tiny_gpt2() if a.from_pretrained is None else None
    args = TrainingArguments(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=4,
                             learning_rate=3e-3, warmup_steps=2, logging_steps=1,
                             save_steps=a.steps // 2, save_strategy="steps", report_to=[],
                             deepspeed=ds, seed=0, use_cpu=not torch.cuda.is_available(),
                             dataloader_num_workers=0, disable_tqdm=True,
                             torch_compile=a.torch_compile is not None,
                             torch_compile_backend=a.torch_compile)
    if model is None:  # TrainingArguments(deepspeed=...) is alive: HF's ZeRO-3 load
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(a.from_pretrained)
    trainer = Trainer(model=model, args=args, train_dataset=Counting(256, 16, 64))
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    if a.torch_compile is not None:
        print(f"compiled {trainer.model_wrapped.is_compiled}")
    finish(trainer, a.out, "loss")


if __name__ == "__main__":
    main()
