"""Final validation-loss gap to ZeRO-3 over several seeds, from `zeropp train --compare` runs.

Each seed's run directory holds one sub-directory per configuration with its
summary.json (same seed: same initial weights and data order in every
configuration). The gap is taken per seed, then its mean and spread reported.

    for s in 0 1 2; do zeropp train --compare zero3,zeropp,zeropp-plus,... --seed $s \\
        --out runs/acc/seed$s; done
    python benchmarks/accuracy.py runs/acc/seed0 runs/acc/seed1 runs/acc/seed2
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from _report import report


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+", help="one --compare run directory per seed")
    p.add_argument("--title", default="accuracy over seeds")
    p.add_argument("--command", default="", help="the command that made the runs (for RESULTS)")
    p.add_argument("--base", default="zero3", help="the configuration gaps are taken to")
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    by_seed = []
    for run in a.runs:
        rows = {d.name: json.loads((d / "summary.json").read_text())
                for d in sorted(Path(run).iterdir()) if (d / "summary.json").exists()}
        by_seed.append(rows)
    names = [n for n in by_seed[0] if all(n in s for s in by_seed)]
    lines = [f"### {a.title}", "", f"Command: `{a.command}`  " if a.command else "",
             f"{len(by_seed)} seeds; gap = final val loss / {a.base}'s (same seed) - 1; "
             "mean, sample standard deviation and range over the seeds.", "",
             "| config | final val loss (mean) | gap mean | gap std | gap min | gap max | "
             f"inter-node MB/node/step | vs {a.base} |", "|---|---|---|---|---|---|---|---|"]
    for n in names:
        vals = [s[n]["final_val_loss"] for s in by_seed]
        gaps = [100 * (s[n]["final_val_loss"] / s[a.base]["final_val_loss"] - 1)
                for s in by_seed]
        sd = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
        mb, base = (by_seed[0][k]["inter_node_MB_per_step"] for k in (n, a.base))
        # (stock FSDP2 is not instrumented: no bytes of its own)
        ratio = f"{mb / base:.3f}" if mb is not None and base else ""
        mb_text = f"{mb:.2f}" if mb is not None else ""
        lines.append(f"| {n} | {statistics.mean(vals):.4f} | {statistics.mean(gaps):+.2f}% | "
                     f"{sd:.2f}% | {min(gaps):+.2f}% | {max(gaps):+.2f}% | {mb_text} | "
                     f"{ratio} |")
    report(lines, a.write)


if __name__ == "__main__":
    main()
