"""TRL's GRPOTrainer on zeropp: the tiny chat model first learns the answer format
by SFT (trl_sft.py's task, a few steps in-process), then GRPO with a rule reward
(1 for an answer of 10 or more) raises the reward. Generation
runs under `deepspeed.zero.GatheredParameters`, which is `zeropp.gathered()`: one
gather per rollout, no per-token collective. The one added line is
`zeropp.install_as_deepspeed()`, before TRL.

    torchrun --nproc-per-node 2 examples/hf/trl_grpo.py --out runs/trl_grpo
"""

import zeropp

zeropp.install_as_deepspeed()  # the one added line: TRL's DeepSpeed path runs on zeropp

import argparse  # noqa: E402

import torch  # noqa: E402
from tiny import chat_model, chats, finish, prompts, tokenizer, with_node_size  # noqa: E402
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto", "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                          "zero_hpz_partition_size": 2, "zero_quantized_gradients": True},
}


def reward_big(completions: list, **kwargs) -> list[float]:
    """The rule: 1 when the answer's last number is 10 or more, else 0. SFT leaves the
    model answering with some number; GRPO moves it to the big ones."""
    out = []
    for c in completions:
        words = (c[0]["content"] if isinstance(c, list) else c).split()
        last = next((w for w in reversed(words) if w.isdigit()), None)
        out.append(1.0 if last is not None and int(last) >= 10 else 0.0)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/trl_grpo")
    p.add_argument("--sft-steps", type=int, default=40)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--node-size", type=int, default=None, help="zeropp: ranks per node")
    a = p.parse_args()
    tok = tokenizer()
    cpu = not torch.cuda.is_available()
    model = chat_model(tok)
    common = dict(report_to=[], deepspeed=with_node_size(DS_CONFIG, a.node_size), seed=0, use_cpu=cpu, logging_steps=1,
                  dataloader_num_workers=0, disable_tqdm=True, bf16=False)
    if not a.resume:  # a format to start from: GRPO's reward needs a number in the answer
        sft = SFTTrainer(model=model, processing_class=tok, train_dataset=chats(256),
                         args=SFTConfig(output_dir=a.out + "/sft", max_steps=a.sft_steps,
                                        per_device_train_batch_size=8, learning_rate=3e-3,
                                        lr_scheduler_type="constant", save_strategy="no",
                                        max_length=32, **common))
        sft.train()
        sft.save_model(a.out + "/sft/final")
        sft.accelerator.wait_for_everyone()  # rank 0 writes it; every rank reads it next
    # A fresh model from the SFT weights (the SFT trainer's own model is sharded).
    model = type(model).from_pretrained(a.out + "/sft/final")
    args = GRPOConfig(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=8,
                      num_generations=8, max_completion_length=6, learning_rate=1e-3,
                      lr_scheduler_type="constant", save_steps=a.steps // 2, beta=0.0,
                      temperature=1.0, **common)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_big, args=args,
                          train_dataset=prompts(256), processing_class=tok)
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    finish(trainer, a.out, "reward")


if __name__ == "__main__":
    main()
