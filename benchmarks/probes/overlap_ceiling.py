"""How much overlap this machine allows: a gloo all-gather across the emulated
nodes and a matmul loop, alone and at once, at each link rate.

4 ranks as 2 nodes x 2 (one torchrun per node namespace),
one thread per rank on 2 cores. If communication were free for the CPU,
"both" would take max(compute, gather); on this machine the kernel's network
path (veth, bridge, tbf) runs on the same two cores as the compute, so at high
link rates "both" approaches their sum. `zeropp bench`'s step / max(compute,
link) column is to be read against the ratio measured here.

    python benchmarks/probes/overlap_ceiling.py --rates 100mbit,1gbit [--write]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _emulated import run_2x2, timed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _report
from _report import report  # noqa: E402


def _rank(out: str, mb: float, matmuls: int, reps: int) -> None:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    w = dist.get_world_size()
    shard = torch.randn(int(mb * 1e6 / 4 / w))
    full = torch.empty(w * shard.numel())
    a, b = torch.randn(384, 384), torch.randn(1536, 384)

    def compute() -> None:
        x = a
        for _ in range(matmuls):
            x = torch.tanh(b @ x)[:384]

    def both() -> None:
        work = dist.all_gather_into_tensor(full, shard, async_op=True)
        compute()
        work.wait()

    timed(compute), timed(lambda: dist.all_gather_into_tensor(full, shard))  # warm-up
    rows = [(timed(compute), timed(lambda: dist.all_gather_into_tensor(full, shard)),
             timed(both)) for _ in range(reps)]
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _measure(rate: str, mb: float, matmuls: int, reps: int) -> list:
    return run_2x2(__file__, rate, "zppo", 29970, [str(mb), str(matmuls), str(reps)])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-worker":
        out, mb, matmuls, reps = sys.argv[2:6]
        _rank(out, float(mb), int(matmuls), int(reps))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--rates", default="100mbit,1gbit")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    # Sized so that compute and the gather take similar times at 1 Gbit/s; at
    # 100 Mbit/s a 10x smaller gather keeps the same balance.
    sizes = {"100mbit": (3.2, 20), "1gbit": (32.0, 20)}
    lines = ["| link | gathered MB | compute s | gather s | both at once s | both / max | "
             "both / sum |", "|---|---|---|---|---|---|---|"]
    for rate in a.rates.split(","):
        mb, matmuls = sizes.get(rate, (32.0, 20))
        rows = _measure(rate, mb, matmuls, a.reps)
        c, g, b = (statistics.median(r[i] for r in rows) for i in range(3))
        lines.append(f"| {rate} | {mb:g} | {c:.3f} | {g:.3f} | {b:.3f} | {b / max(c, g):.2f} | "
                     f"{b / (c + g):.2f} |")
    report([f"### Overlap ceiling of this machine ({time.strftime('%Y-%m-%d')})", "",
            f"Command: `python benchmarks/probes/overlap_ceiling.py {' '.join(sys.argv[1:])}`  ",
            "4 ranks as 2 nodes x 2 on the emulated cluster (gloo, 1 thread per rank, 2 "
            f"cores); median of {a.reps}. A ring all-gather across the nodes and a matmul loop "
            "of similar length, alone and at once (the gather issued async, then the loop, "
            "then wait). 1.00 in \"both / max\" is perfect overlap; 1.00 in \"both / sum\" none.",
            "", *lines], a.write)


if __name__ == "__main__":
    main()
