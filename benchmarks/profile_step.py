"""Where rank 0's main thread spends a training step: cProfile of 6 steps of
gpt-6x384 (fp32, AdamW, batch 2 x 64) at W=4 as 2 x 2 on loopback, per preset,
sorted by own time, with every rank's s/step. Used to find zeropp-plus's extra
compute over zeropp (RESULTS.md, "zeropp-plus's compute").

    python benchmarks/profile_step.py zeropp zeropp-plus
"""
import cProfile
import io
import pstats
import sys
import time

import torch
import torch.distributed as dist

import zeropp
from zeropp.launch import spawn
from zeropp.train.model import GPT, GPTConfig


def work(preset):
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=6, n_embd=384, n_head=6))
    zeropp.shard(model, zeropp.Config.preset(preset, node_size=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)

    def step():
        x = torch.randint(0, 256, (2, 64), generator=g)
        model(x, x)[1].backward()
        zeropp.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
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
