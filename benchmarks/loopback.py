"""Configurations side by side on loopback (gloo, W local ranks): zeropp's
ZeRO-3 and ZeRO++ switches, and PyTorch FSDP2 (`fully_shard`) on the same GPT,
the same units (each block + the root), the same data. All run inside one set
of workers, alternating rounds, so machine noise hits each alike; results are
ratios of median step times, and bytes from zeropp's accounting.

    python benchmarks/loopback.py --configs zero3,fsdp2 [--write]
    python benchmarks/loopback.py --configs zero3,qwz,hpz,qgz,zeropp [--write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from _report import report

import zeropp
from zeropp.cli.launch import spawn
from zeropp.config import NAMED, is_named, named
from zeropp.train.model import GPT, GPTConfig


def _model(a) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=a.seq_len, n_layer=a.n_layer,
                         n_head=a.n_head, n_embd=a.n_embd))


def _build(name: str, a):
    if name == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        m = _model(a)
        mp = MixedPrecisionPolicy(param_dtype=a.dtype, reduce_dtype=torch.float32)
        for block in m.h:
            fully_shard(block, mp_policy=mp)
        fully_shard(m, mp_policy=mp)
        return m
    param_dtype = None if a.dtype == torch.float32 else a.dtype
    return zeropp.shard(_model(a), named(name, a.node_size, param_dtype=param_dtype))


def _worker(a) -> dict:
    rank = dist.get_rank()
    models = {name: _build(name, a) for name in a.configs}
    opts = {k: torch.optim.AdamW(v.parameters(), lr=1e-4) for k, v in models.items()}
    x = torch.randint(0, 256, (a.batch, a.seq_len), generator=torch.Generator().manual_seed(rank))
    times = {k: [] for k in models}
    losses = {k: [] for k in models}

    def step(name):
        model, opt = models[name], opts[name]
        dist.barrier()
        t0 = time.perf_counter()
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        return time.perf_counter() - t0, loss.item()

    for name in models:  # warm-up: the first step learns the unit order
        step(name)
        if name != "fsdp2":
            zeropp.reset_comm_stats(models[name])
    for _ in range(a.rounds):
        for name in models:
            for _ in range(a.steps):
                dt, loss = step(name)
                times[name].append(dt)
                losses[name].append(loss)
    stats = {k: zeropp.comm_stats(m) for k, m in models.items() if k != "fsdp2"}
    return {"times": times, "losses": losses, "stats": stats,
            "params": sum(p.numel() for p in _model(a).parameters()),
            "threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="zero3,fsdp2",
                   help=f"comma-separated, from {','.join([*NAMED, 'fsdp2'])}")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--node-size", type=int, default=2)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="steps per round per config")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    a = p.parse_args()
    a.configs = a.configs.split(",")
    a.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    for c in a.configs:
        if not is_named(c) and c != "fsdp2":
            p.error(f"unknown config {c!r}")
    out = spawn(_worker, a.world, a.node_size, args=(a,), timeout=3600)
    base = a.configs[0]
    med = {k: statistics.median(v) for k, v in out[0]["times"].items()}
    n_steps = a.rounds * a.steps
    nodes = a.world // a.node_size

    def per_node(cfg, key):  # max over nodes of the node's bytes per step
        return max(sum(out[r]["stats"][cfg][key] for r in range(m * a.node_size,
                                                                 (m + 1) * a.node_size))
                   for m in range(nodes)) / n_steps

    lines = [
        f"### Loopback: {', '.join(a.configs)} ({time.strftime('%Y-%m-%d')})", "",
        f"Command: `python benchmarks/loopback.py {' '.join(sys.argv[1:])}`  ",
        f"GPT {out[0]['params'] / 1e6:.2f}M params, compute {str(a.dtype)[6:]}, W={a.world} "
        f"ranks on loopback (gloo) as {nodes} nodes x {a.node_size}, micro-batch {a.batch} x "
        f"{a.seq_len}, {n_steps} timed steps per config in {a.rounds} alternating rounds, "
        f"torch {torch.__version__}, {out[0]['threads']} thread(s) per rank. Bytes: zeropp's "
        "accounting, per node per step (FSDP2 is not instrumented).", "",
        f"| config | median s/step | min | max | time vs {base} | inter-node MB | "
        f"vs {base} | intra-node MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k in a.configs:
        t = out[0]["times"][k]
        row = f"| {k} | {med[k]:.3f} | {min(t):.3f} | {max(t):.3f} | {med[k] / med[base]:.2f} |"
        if k in out[0]["stats"]:
            inter, intra = per_node(k, "inter_node_bytes"), per_node(k, "intra_node_bytes")
            rel = (f"{inter / per_node(base, 'inter_node_bytes'):.3f}"
                   if base in out[0]["stats"] else "")
            row += f" {inter / 1e6:.2f} | {rel} | {intra / 1e6:.2f} |"
        else:
            row += " n/a | | n/a |"
        lines.append(row)
    ref = out[0]["losses"][base]
    lines += ["", "Largest gap of each config's rank-0 loss to " + base + "'s, step by step: "
              + ", ".join(f"{k} {max(abs(u - v) for u, v in zip(out[0]['losses'][k], ref)):.1e}"
                          for k in a.configs if k != base) + ".", ""]
    report(lines, a.write)


if __name__ == "__main__":
    main()
