"""How qWD's blocks move in real training: the share of blocks per step whose codes
moved on the old grid (k = 0: an integer subtraction, an int8 add), that needed the old
codes rescaled to the new scale but still landed exactly (k = 1), and that moved
farther than the delta carries (k > 1: within k/2 codes, the rest sent next time).

Single process, no sharding: the model's parameters flattened into one shard, the
owner's `qwd.encode` after every AdamW step of `zeropp train`'s schedule (warm-up,
cosine decay, weight decay 0.1, clipping at 1.0) on the Shakespeare text.

    python benchmarks/probes/qwd_moves.py [--model small] [--lr 2e-3] [--steps 300]
"""
import argparse

import torch

from zeropp import qwd
from zeropp.quant import quantize
from zeropp.train.data import get_batch, shakespeare_text, split_tokens
from zeropp.train.loop import TrainArgs, lr_at
from zeropp.train.model import GPT, PRESETS, GPTConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="small")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--block", type=int, default=2048)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, **PRESETS[a.model]))
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.1)
    train, _ = split_tokens(torch.tensor(list(shakespeare_text().encode())), 64)
    g, sched = torch.Generator().manual_seed(0), TrainArgs(steps=a.steps, lr=a.lr)

    def shard() -> torch.Tensor:
        v = torch.cat([q.detach().reshape(-1) for q in params])
        return torch.nn.functional.pad(v, (0, -v.numel() % a.block))

    n = shard().numel()
    nb = n // a.block
    copy = quantize(shard(), 8, a.block).to_bytes().clone()
    delta = torch.empty(qwd.wire_bytes(n, a.block), dtype=torch.uint8)
    total = torch.zeros(3)
    print(f"{a.model}: {n:,} values in {nb} blocks of {a.block}; INT4 moves, lr {a.lr}")
    print("| steps | lr | k = 0 (old grid) | k = 1 (rescaled, exact) | k > 1 (lagging) |")
    print("|---|---|---|---|---|")
    window = torch.zeros(3)
    for step in range(a.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, sched)
        x, y = get_batch(train, 8, 64, g)
        opt.zero_grad()
        model(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        qwd.encode(shard(), copy, delta, block=a.block)
        k = delta[nb * 4:nb * 5]
        counts = torch.stack([(k == 0).sum(), (k == 1).sum(), (k > 1).sum()]).float()
        total += counts
        window += counts
        if (step + 1) % max(1, a.steps // 10) == 0 or step + 1 == a.steps:
            share = window / window.sum()
            print(f"| to {step + 1} | {lr_at(step, sched):.1e} | {share[0]:.2%} | {share[1]:.2%} "
                  f"| {share[2]:.2%} |")
            window.zero_()
    share = total / total.sum()
    print(f"| all {a.steps} | | **{share[0]:.2%}** | {share[1]:.2%} | {share[2]:.2%} |")


if __name__ == "__main__":
    main()
