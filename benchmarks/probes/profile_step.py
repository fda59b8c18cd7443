"""Where rank 0's main thread spends a training step: cProfile of 6 steps of
gpt-6x384 (fp32, AdamW, batch 2 x 64) at W=4 as 2 x 2 on loopback, per preset,
sorted by own time, with every rank's s/step. Used to find zeropp-plus's extra
compute over zeropp (RESULTS.md, "zeropp-plus's compute").

    python benchmarks/probes/profile_step.py zeropp zeropp-plus
"""
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _gpt_step
from _gpt_step import batch, sharded_gpt, train_step  # noqa: E402

from zeropp.cli.launch import spawn  # noqa: E402


def work(preset):
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model, opt = sharded_gpt(preset)
    g = torch.Generator().manual_seed(rank)

    def step():
        train_step(model, opt, batch(g))
    for _ in range(2):
        step()
    dist.barrier()
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    for _ in range(6):
        step()
    pr.disable()
    el = time.perf_counter() - t
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    return el / 6, s.getvalue() if rank == 0 else ""


if __name__ == "__main__":
    for p in sys.argv[1:]:
        res = spawn(work, 4, 2, args=(p,), timeout=600)
        print("=====", p, "s/step", [round(r[0], 3) for r in res])
        print(res[0][1])
