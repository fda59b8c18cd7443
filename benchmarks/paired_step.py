"""Presets side by side in one world, their steps alternating, so the machine's
drift (±20% by the hour here) hits both alike: gpt-6x384 (fp32, AdamW, batch
2 x 64) at W=4 as 2 x 2 on loopback, unshaped. Per preset: median / min / max
s/step, the paired ratio to the first preset, CPU seconds per step summed over the
four ranks (every thread) and minor page faults per step (all ranks), and the ranks' peak RSS.

    python benchmarks/paired_step.py zeropp,zeropp-plus [steps] [LAYERSxWIDTH or hf-gpt2, default 6x384] [warm-up steps, default 2]

(hf-gpt2: Hugging Face's GPT-2 124M, built from its default config.)

More warm-up steps measure later training: the first AdamW steps move every weight
by about the lr, which costs qWD more than later steps do (benchmarks/probes/qwd_cost.py).

Each step clips gradients (`zeropp.clip_grad_norm_`, as `zeropp train` does; the
bench worker does not), and each preset's model sees its own batches: the times
are comparable between presets of one run, not with bench rows. Used for
RESULTS.md's "zeropp-plus's compute" readings; environment variables (e.g.
ZEROPP_KEEP_MALLOC=1) apply to every preset of the run. `PRESET@eager` runs the
preset with the eager codecs (ZEROPP_COMPILE=0 during its steps), `PRESET@compiled`
with the compiled ones from their default sizes (zeropp/kernels.py, MIN_NUMEL),
`PRESET@every-size` with them at every size, `PRESET@model` with the default codecs
and the model compiled in place (`model.compile()`), so they alternate in one world.
"""
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
from _gpt_step import batch, sharded_gpt, train_step

from zeropp.cli.launch import spawn


def _usage() -> tuple[float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this rank
    return r.ru_utime + r.ru_stime, r.ru_minflt


def work(presets: list[str], steps: int, layers: int = 6, width: int = 384,
         warmup: int = 2, hf: bool = False) -> tuple:
    torch.set_num_threads(1)
    runs = [sharded_gpt(p.split("@")[0], layers, width, hf) for p in presets]
    for p, (m, _) in zip(presets, runs):
        if p.endswith("@model"):
            m.compile()  # in place, as engine.compile()
    from zeropp import kernels
    least, user = kernels.MIN_NUMEL, os.environ.get("ZEROPP_COMPILE")
    g = torch.Generator().manual_seed(dist.get_rank())
    out: list[list[tuple[float, float, int]]] = [[] for _ in presets]
    for i in range(steps + warmup):  # warm-up steps first, each
        for k, (m, opt) in enumerate(runs):
            mode = presets[k].partition("@")[2]
            if mode:
                os.environ["ZEROPP_COMPILE"] = "0" if mode == "eager" else "1"
            elif user is None:  # plain PRESET: the library's default, or the caller's
                os.environ.pop("ZEROPP_COMPILE", None)
            else:
                os.environ["ZEROPP_COMPILE"] = user
            kernels.MIN_NUMEL = {8: 0, 4: 0} if mode == "every-size" else least
            x = batch(g)
            dist.barrier()
            cpu0, flt0 = _usage()
            t = time.perf_counter()
            train_step(m, opt, x)
            dist.barrier()
            cpu1, flt1 = _usage()
            if i >= warmup:
                out[k].append((time.perf_counter() - t, cpu1 - cpu0, flt1 - flt0))
    return out, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    presets = sys.argv[1].split(",")
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    shape = sys.argv[3] if len(sys.argv) > 3 else "6x384"
    hf = shape == "hf-gpt2"
    layers, width = (12, 768) if hf else (int(x) for x in shape.split("x"))
    warmup = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    got = spawn(work, 4, 2, args=(presets, steps, layers, width, warmup, hf), timeout=3000)
    res = [r for r, _ in got]
    print(f"peak RSS per rank (all presets of the run): {max(m for _, m in got):.0f} MB")
    base = [t for t, _, _ in res[0][0]]
    for k, p in enumerate(presets):
        ts = [t for t, _, _ in res[0][k]]
        cpu = sum(c for r in res for _, c, _ in r[k]) / steps
        faults = sum(f for r in res for _, _, f in r[k]) / steps
        ratio = statistics.median(b / a for a, b in zip(base, ts))
        print(f"{p:28s} s/step median {statistics.median(ts):.3f} (min {min(ts):.3f} max "
              f"{max(ts):.3f})  paired vs {presets[0]} {ratio:.3f}  CPU s/step {cpu:.3f}  "
              f"faults/step {faults:.0f}")
