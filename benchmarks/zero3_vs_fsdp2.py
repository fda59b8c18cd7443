"""zeropp ZeRO-3 against PyTorch FSDP2 (`fully_shard`) on the same GPT, the
same units (each block + the root), the same data, fp32, W ranks on loopback
(gloo). Both run inside one set of workers, alternating rounds, so machine
noise hits both alike; the result is the ratio of median step times.

    python benchmarks/zero3_vs_fsdp2.py [--write]   (make bench)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zeropp
from zeropp.launch import spawn
from zeropp.train.model import GPT, GPTConfig


def _model(a) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=a.seq_len, n_layer=a.n_layer,
                         n_head=a.n_head, n_embd=a.n_embd))


def _worker(a) -> dict:
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    models = {}
    models["zeropp"] = zeropp.shard(_model(a), zeropp.Config(node_size=a.node_size))
    m = _model(a)
    for block in m.h:
        fully_shard(block)
    fully_shard(m)
    models["fsdp2"] = m
    opts = {k: torch.optim.AdamW(v.parameters(), lr=1e-4) for k, v in models.items()}
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (a.batch, a.seq_len), generator=gen)
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

    for name in models:  # warm-up
        step(name)
    zeropp.reset_comm_stats(models["zeropp"])
    for _ in range(a.rounds):
        for name in models:
            for _ in range(a.steps):
                dt, loss = step(name)
                times[name].append(dt)
                losses[name].append(loss)
    stats = zeropp.comm_stats(models["zeropp"])
    n = sum(p.numel() for p in _model(a).parameters())
    return {"times": times, "losses": losses, "params": n, "stats": stats,
            "threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--node-size", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="steps per round per config")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    a = p.parse_args()
    out = spawn(_worker, a.world, a.node_size, args=(a,), timeout=3600)
    med = {k: statistics.median(v) for k, v in out[0]["times"].items()}
    ratio = med["zeropp"] / med["fsdp2"]
    n_steps = a.rounds * a.steps
    node0 = range(a.node_size)
    inter = sum(out[r]["stats"]["inter_node_bytes"] for r in node0) / (n_steps + 0)
    cmd = "python benchmarks/zero3_vs_fsdp2.py " + " ".join(sys.argv[1:])
    lines = [
        f"### ZeRO-3: zeropp vs PyTorch FSDP2 ({time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `{cmd.strip()}`  ",
        f"GPT {out[0]['params'] / 1e6:.2f}M params fp32, W={a.world} ranks on loopback "
        f"(gloo, node size {a.node_size}), micro-batch {a.batch} x {a.seq_len}, "
        f"{n_steps} timed steps per config in {a.rounds} alternating rounds, torch "
        f"{torch.__version__}, {out[0]['threads']} thread(s) per rank.",
        "",
        "| config | median s/step | min | max | ratio to FSDP2 |",
        "|---|---|---|---|---|",
    ]
    for k in ("zeropp", "fsdp2"):
        t = out[0]["times"][k]
        lines.append(f"| {k} | {med[k]:.3f} | {min(t):.3f} | {max(t):.3f} | "
                     f"{med[k] / med['fsdp2']:.2f} |")
    lines += ["", f"zeropp step-time ratio to FSDP2: **{ratio:.2f}** (target <= 1.1). "
              f"zeropp inter-node bytes per node per step (accounting): {inter / 1e6:.2f} MB; "
              f"ZeRO-3 analytic 3(W-1)/W*M = "
              f"{3 * (a.world - 1) / a.world * 4 * out[0]['params'] / 1e6:.2f} MB.", ""]
    lz, lf = out[0]["losses"]["zeropp"], out[0]["losses"]["fsdp2"]
    lines.append(f"Same model, data and steps: rank-0 losses of the two agree to "
                 f"{max(abs(u - v) for u, v in zip(lz, lf)):.1e} at most.")
    lines.append("")
    text = "\n".join(lines)
    print(text)
    if a.write:
        path = Path(__file__).with_name("RESULTS.md")
        old = path.read_text() if path.exists() else "# Benchmark results\n\n"
        path.write_text(old.rstrip("\n") + "\n\n" + text)


if __name__ == "__main__":
    main()
