"""Per-rank memory the engine holds between steps, by kind, for named configurations.

Counts the tensors themselves (`zeropp.memory_stats`, not the allocator): fp32
master shards, AdamW state, hpZ secondaries / qWD copies, and the error-feedback
residuals of the inter-node gradient hop, after two training steps (W ranks as nodes of D, on
loopback). `--write` appends the table to benchmarks/RESULTS.md.

    python benchmarks/memory.py --configs zero3,zeropp,zeropp-plus,zeropp-plus~ef
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from _report import report

import zeropp
from zeropp.cli.launch import spawn
from zeropp.config import named
from zeropp.train.model import GPT, PRESETS, GPTConfig


def _held(name: str, model_name: str, d: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, **PRESETS[model_name]))
    zeropp.shard(model, named(name, d))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        x = torch.randint(0, 256, (2, 64), generator=g)
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
        x = torch.randint(0, 256, (2, 64), generator=g)
        with torch.no_grad():
            model(x)  # a forward after the step: copies current, as in training
    m = zeropp.memory_stats(model, opt)
    return {"master": m["master_shards"], "optimizer": m["optimizer_state"],
            "secondary": m["secondary_shards"], "residual": m["error_feedback"],
            "params": sum(f.numel for f in model._zeropp_state.flats)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="zero3,zeropp,zeropp-plus,zeropp-plus~ef")
    p.add_argument("--model", default="gpt-6x256", choices=list(PRESETS))
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--node-size", type=int, default=2)
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    w, d = a.nodes * a.node_size, a.node_size
    rows = ["| config | master MB | AdamW state MB | hpZ secondary / qWD copies MB | "
            "error-feedback MB | total MB | vs zero3 |", "|---|---|---|---|---|---|---|"]
    base = None
    for name in a.configs.split(","):
        r = spawn(_held, w, d, args=(name, a.model, d), timeout=600)[0]
        total = r["master"] + r["optimizer"] + r["secondary"] + r["residual"]
        base = base or total
        rows.append(f"| {name} | {r['master'] / 1e6:.2f} | {r['optimizer'] / 1e6:.2f} | "
                    f"{r['secondary'] / 1e6:.2f} | {r['residual'] / 1e6:.2f} | "
                    f"{total / 1e6:.2f} | {total / base:.2f} |")
    head = (f"GPT {a.model} ({r['params'] / 1e6:.2f}M params), fp32, W={w} as {a.nodes} nodes "
            f"x {d}; rank 0 after two steps and a forward; tensors only (gathered weights "
            "and activations are transient and equal across configs)")
    cmd = "python benchmarks/memory.py " + " ".join(sys.argv[1:])
    report([f"### Memory per rank: {a.configs} ({time.strftime('%Y-%m-%d')})", "",
            f"Command: `{cmd}`  ", head + ".", "", *rows], a.write)


if __name__ == "__main__":
    main()
