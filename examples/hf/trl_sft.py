"""TRL's SFTTrainer on zeropp: a tiny Llama-style chat model learns to answer
"what is a plus b ?" from a small chat set, with ZeRO-3 and the ZeRO++ keys.
The one added line is `zeropp.install_as_deepspeed()`, before TRL.

    torchrun --nproc-per-node 2 examples/hf/trl_sft.py --out runs/trl_sft
"""

import zeropp

zeropp.install_as_deepspeed()  # the one added line: TRL's DeepSpeed path runs on zeropp

import argparse  # noqa: E402

import torch  # noqa: E402
from tiny import chat_model, chats, finish, tokenizer, with_node_size  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto", "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                          "zero_hpz_partition_size": 2, "zero_quantized_gradients": True},
    "zeropp": {"preset": "zeropp-plus"},
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/trl_sft")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--node-size", type=int, default=None, help="zeropp: ranks per node")
    a = p.parse_args()
    ds = with_node_size(DS_CONFIG, a.node_size)
    tok = tokenizer()
    args = SFTConfig(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=8,
                     learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1,
                     save_steps=a.steps // 2, report_to=[], deepspeed=ds, seed=0,
                     use_cpu=not torch.cuda.is_available(), max_length=32,
                     dataloader_num_workers=0, disable_tqdm=True, bf16=False)
    trainer = SFTTrainer(model=chat_model(tok), args=args, train_dataset=chats(512),
                         processing_class=tok)
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    finish(trainer, a.out, "loss")


if __name__ == "__main__":
    main()
