"""Where each preset's CPU goes, by thread and by phase: gpt-6x384 (fp32, AdamW,
batch 2 x 64) at W=4 as 2 x 2 on loopback, unshaped, each preset in its own world
in turn, `--reps` times. On this 2-core machine the four ranks keep both cores
busy, so a step takes about (CPU of all ranks) / 2 and a preset is faster exactly
when it does less work; this says which thread and which phase does the extra.

Per rank and step (mean of the four ranks), in CPU milliseconds:
- by thread (user + sys, from /proc/self/task): the main thread, the reduce
  pipeline's two threads, gloo's threads;
- the main thread by phase (`time.thread_time`): forward, backward, optimizer
  step, and inside them the weight path's quantization, dequantization and
  gather issue (zeropp.weights), whichever phase they ran in.

    python benchmarks/cpu_attribution.py zeropp,zeropp-plus [--steps 12] [--reps 2] [--warmup 3]
"""

from __future__ import annotations

import argparse
import collections
import os
import threading
import time

import torch
import torch.distributed as dist
from _gpt_step import batch, sharded_gpt

import zeropp
import zeropp.qwd as qwd_mod
import zeropp.weights as weights_mod
import zeropp.weights.hpz as weights_hpz
import zeropp.weights.world as weights_world
from zeropp.cli.launch import spawn

_TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def _threads() -> dict[int, tuple[str, int]]:
    """tid -> (kind, user + sys clock ticks) for every thread of this process."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    main = threading.main_thread().native_id
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            st = f.read()
        comm = st[st.index("(") + 1:st.rindex(")")]
        fields = st[st.rindex(")") + 2:].split()
        kind = "main" if int(tid) == main else names.get(int(tid), comm)
        out[int(tid)] = (kind, int(fields[11]) + int(fields[12]))
    return out


def _timed(acc: dict, owner, name: str, key: str) -> None:
    """Count the main thread's CPU time inside owner.name under `key`."""
    real = getattr(owner, name)

    def wrapper(*a, **k):
        t = time.thread_time()
        try:
            return real(*a, **k)
        finally:
            acc[key] += time.thread_time() - t
    setattr(owner, name, wrapper)


def work(preset: str, steps: int, warmup: int = 3) -> dict[str, float]:
    torch.set_num_threads(1)
    acc: dict[str, float] = collections.defaultdict(float)
    _timed(acc, weights_world, "quantize", "  weight path: quantize")
    for mod in (weights_world, weights_hpz):
        _timed(acc, mod, "dequantize_pieces", "  weight path: dequantize gathered")
    _timed(acc, weights_mod.WeightPath, "issue", "  weight path: issue (incl. its quantize)")
    _timed(acc, weights_mod.WeightPath, "finish", "  weight path: finish (incl. stage 2)")
    _timed(acc, qwd_mod, "encode", "  weight path: qWD owner's encode")
    _timed(acc, qwd_mod, "apply", "  weight path: qWD holder's apply")
    model, opt = sharded_gpt(preset)
    g = torch.Generator().manual_seed(dist.get_rank())

    def phase(key: str, fn):
        t = time.thread_time()
        out = fn()
        acc[key] += time.thread_time() - t
        return out

    def step() -> None:
        x = batch(g)
        loss = phase("main: forward", lambda: model(x, x)[1])
        phase("main: backward", loss.backward)
        phase("main: clip + optimizer step", lambda: (zeropp.clip_grad_norm_(model, 1.0),
                                                      opt.step(), opt.zero_grad()))
    for _ in range(warmup):
        step()
    acc.clear()
    dist.barrier()
    before = _threads()
    for _ in range(steps):
        step()
    after = _threads()
    dist.barrier()
    out = {k: v * 1e3 / steps for k, v in acc.items()}
    for tid, (kind, ticks) in after.items():
        key = f"thread: {kind}"
        out[key] = out.get(key, 0.0) + (ticks - before.get(tid, (kind, 0))[1]) * _TICK_MS / steps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("presets")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3,
                    help="steps before measuring (more: later training, where qWD's blocks "
                         "move less; benchmarks/probes/qwd_cost.py)")
    args = ap.parse_args()
    presets = args.presets.split(",")
    for rep in range(args.reps):
        table = {}
        for p in presets:
            ranks = spawn(work, 4, 2, args=(p, args.steps, args.warmup), timeout=900)
            keys = set().union(*ranks)
            table[p] = {k: sum(r.get(k, 0.0) for r in ranks) / len(ranks) for k in keys}
        keys = sorted(set().union(*table.values()))
        print(f"round {rep + 1}: CPU ms per rank per step (mean of 4 ranks)")
        print(f"{'':44s}" + "".join(f"{p:>16s}" for p in presets))
        for k in keys:
            print(f"{k:44s}" + "".join(f"{table[p].get(k, 0.0):16.1f}" for p in presets))
        total = {p: sum(v for k, v in table[p].items() if k.startswith("thread:"))
                 for p in presets}
        print(f"{'all threads':44s}" + "".join(f"{total[p]:16.1f}" for p in presets))
        print()


if __name__ == "__main__":
    main()
