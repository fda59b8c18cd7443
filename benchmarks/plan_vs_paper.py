"""`zeropp plan` against ZeRO++'s published throughput.

The published points are the DeepSpeed ZeRO++ blog's Figs. 6-8 (the TFLOP/s
labels printed on the bars; 384 V100 = 24 DGX-2 nodes x 16, inter-node 1 or 4 x
100 Gbit/s InfiniBand, or 200 / 800 for Fig. 8; 1K or 2K tokens per GPU; sources
quoted in RESULTS.md). Each is predicted with the hardware only: V100 NVSwitch
1200 Gbit/s per GPU inside a node, 60 TFLOP/s achieved per V100, activation
checkpointing on (as in those runs: the published TFLOP/s count the forward's
recomputation, 8 * params * tokens per step), 40 blocks for 18B (the tutorial's
`--num-layers 40`), 32 for the others (not published), the plan's defaults for
the rest (10 us per hop, no overlap). No constant is fitted per point.

    python benchmarks/plan_vs_paper.py [--tflops 60] [--no-recompute] [--write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _report import report

from zeropp.bench.plan import Cluster, plan

# (figure, params, inter-node Gbit/s per node, tokens per GPU, ZeRO-3 TFLOP/s, ZeRO++ TFLOP/s)
POINTS = [
    ("Fig.6", 18e9, 400, 1024, 25, 35), ("Fig.6", 49e9, 400, 1024, 23, 36),
    ("Fig.6", 91e9, 400, 1024, 23, 36), ("Fig.6", 138e9, 400, 1024, 23, 36),
    ("Fig.6", 18e9, 400, 2048, 40, 53), ("Fig.6", 49e9, 400, 2048, 36, 51),
    ("Fig.6", 91e9, 400, 2048, 36, 51), ("Fig.6", 138e9, 400, 2048, 36, 50),
    ("Fig.7", 18e9, 100, 1024, 14, 31), ("Fig.7", 49e9, 100, 1024, 11, 22),
    ("Fig.7", 91e9, 100, 1024, 11, 22), ("Fig.7", 138e9, 100, 1024, 11, 22),
    ("Fig.7", 18e9, 100, 2048, 26, 46), ("Fig.7", 49e9, 100, 2048, 20, 38),
    ("Fig.7", 91e9, 100, 2048, 20, 38), ("Fig.7", 138e9, 100, 2048, 20, 38),
    ("Fig.8", 18e9, 200, 2048, 37, 50), ("Fig.8", 18e9, 800, 2048, 47, 54),
    ("Fig.8", 138e9, 200, 2048, 32, 48), ("Fig.8", 138e9, 800, 2048, 48, 55),
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tflops", type=float, default=60.0, help="achieved per V100")
    p.add_argument("--intra-gbps", type=float, default=1200.0, help="NVSwitch, per GPU")
    p.add_argument("--no-recompute", action="store_true",
                   help="charge 6 instead of 8 FLOPs per param per token")
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    rows = ["| figure | params | link Gbit/s | tokens/GPU | published ZeRO-3 / ZeRO++ TFLOP/s | "
            "published speedup | predicted | error |", "|---|---|---|---|---|---|---|---|"]
    errs = []
    for fig, params, gbps, tokens, z3, zpp in POINTS:
        c = Cluster(params=params, nodes=24, gpus_per_node=16, inter_gbps=gbps,
                    intra_gbps=a.intra_gbps, tokens_per_gpu=tokens, tflops=a.tflops,
                    units=40 if params == 18e9 else 32, recompute=not a.no_recompute)
        pred = {r["config"]: r for r in plan(c)}["zeropp"]["speedup"]
        pub = zpp / z3
        errs.append(abs(pred - pub) / pub)
        rows.append(f"| {fig} | {params / 1e9:.0f}B | {gbps} | {tokens} | {z3} / {zpp} | "
                    f"{pub:.2f}x | {pred:.2f}x | {errs[-1]:.1%} |")
    summary = (f"Mean error {statistics.mean(errs):.1%}, worst {max(errs):.1%}, "
               f"{sum(e <= 0.10 for e in errs)} of {len(errs)} within 10%.")
    cmd = "python benchmarks/plan_vs_paper.py " + " ".join(sys.argv[1:])
    report([f"### zeropp plan vs the published ZeRO++ speedups ({time.strftime('%Y-%m-%d')})", "",
            f"Command: `{cmd}`  ", "384 V100 (24 x 16), " + (
                "activation checkpointing (8 PT FLOPs)" if not a.no_recompute else "6 PT FLOPs")
            + f", {a.tflops:g} TFLOP/s achieved, intra-node {a.intra_gbps:g} Gbit/s per GPU.",
            "", *rows, "", summary], a.write)


if __name__ == "__main__":
    main()
