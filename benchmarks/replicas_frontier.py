"""Validation loss against cross-node bytes for replica groups under torchft: HSDP every
step and DiLoCo every H steps, each with torchft's own fp32 or a zeropp codec between
the groups, over seeds. The runs are `zeropp train --replicas 2` on unshaped loopback
(the loss does not depend on the link); bytes are zeropp's accounting of what the
wrapped group sent between the groups.

    python benchmarks/replicas_frontier.py run --out runs/frontier      # resumable
    python benchmarks/replicas_frontier.py report --out runs/frontier --write

`run` skips every run whose summary.md exists, so it can be stopped and started again;
while OUT/PAUSE exists it starts no new run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _report import report

STEPS = 2048  # a multiple of every H
ORDER = [(1, "fp32"), (32, "2bit"), (32, "fp32"), (1, "2bit"), (8, "2bit"), (128, "2bit"),
         (8, "fp32"), (128, "fp32"), (1, "int4"), (8, "int4"), (32, "int4"), (128, "int4")]
BASE = (1, "fp32")  # stock HSDP


def run_dir(out: Path, H: int, codec: str, seed: int, tag: str = "") -> Path:
    return out / f"H{H}-{codec}{tag}" / f"seed{seed}"


def command(d: Path, H: int, codec: str, seed: int, model: str, extra: list) -> list[str]:
    return [sys.executable, "-m", "zeropp", "train", "--replicas", "2", "--nproc", "4",
            "--model", model, "--steps", str(STEPS), "--sync-every", str(H), "--outer-codec",
            codec, "--seed", str(seed), "--eval-every", "32", "--log-every", "256",
            "--out", str(d), *extra]


def do_run(a: argparse.Namespace) -> None:
    todo = [(H, c, s) for s in a.seeds for (H, c) in ORDER if (H, c) in a.only]
    # the first pairs' every seed, then every other pair's first seed, then the rest
    todo.sort(key=lambda t: (0 if t[:2] in a.first else 1 if t[2] == a.seeds[0] else 2,
                             a.seeds.index(t[2]), ORDER.index(t[:2])))
    for H, codec, seed in todo:
        d = run_dir(a.out, H, codec, seed, a.tag)
        if (d / "summary.md").exists():
            continue
        while (a.out / "PAUSE").exists():  # another measurement wants the CPU to itself
            time.sleep(5)
        shutil.rmtree(d, ignore_errors=True)
        d.parent.mkdir(parents=True, exist_ok=True)
        print(f"H={H} {codec} seed {seed}", flush=True)
        with open(d.parent / f"seed{seed}.log", "w") as log:
            r = subprocess.run(command(d, H, codec, seed, a.model, a.extra.split()), stdout=log,
                               stderr=subprocess.STDOUT)
        if r.returncode != 0:
            print(f"  failed ({r.returncode}); see {d.parent / f'seed{seed}.log'}", flush=True)


def curve(d: Path) -> list[tuple[int, float]]:
    """(steps taken, val loss) of replica group 0."""
    rows = [json.loads(x) for x in (d / "replica0" / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"] + 1, r["val_loss"]) for r in rows if "val_loss" in r]


def bytes_per_step(d: Path) -> float:
    rows = [json.loads(x) for x in (d / "replica0" / "metrics.jsonl").read_text().splitlines()]
    return sum(r["cross_node_bytes"] for r in rows) / len(rows)


def load(out: Path) -> dict:
    """{(H, codec, tag): {seed: run directory}} of every finished run under `out`."""
    runs = {}
    for d in sorted(out.glob("H*-*/seed*")):
        if (d / "summary.md").exists():
            H, rest = d.parent.name[1:].split("-", 1)
            codec, _, tag = rest.partition("-")
            runs.setdefault((int(H), codec, tag), {})[int(d.name[4:])] = d
    return dict(sorted(runs.items(), key=lambda kv: (kv[0][1] != "fp32", kv[0][1],
                                                      kv[0][0], kv[0][2])))


def do_report(a: argparse.Namespace) -> None:
    runs = load(a.out)
    base = runs.get((*BASE, ""), {})
    lines = ["### Replicas over slow links: validation loss against cross-node bytes", "",
             f"Command: `python benchmarks/replicas_frontier.py run --out {a.out}` (each run "
             f"`zeropp train --replicas 2 --nproc 4 --model {a.model} --steps {STEPS} "
             "--sync-every H --outer-codec C --seed S --eval-every 32`; loopback links), then "
             "`report`. Gap: final val loss / stock HSDP's (H=1, fp32) of the same seed - 1; "
             "bytes: what replica group 0 sent to the other group per step (zeropp's "
             "accounting, both ranks).", "",
             "| H | between groups | seeds | final val loss (mean ± std) | gap mean | gap range "
             "| cross-node bytes/step | vs stock HSDP |", "|---|---|---|---|---|---|---|---|"]
    b0 = statistics.mean(bytes_per_step(d) for d in base.values()) if base else None
    points = []
    for (H, codec, tag), by_seed in runs.items():
        finals = {s: curve(d)[-1][1] for s, d in by_seed.items()}
        gaps = [100 * (v / curve(base[s])[-1][1] - 1) for s, v in finals.items() if s in base]
        bps = statistics.mean(bytes_per_step(d) for d in by_seed.values())
        sd = statistics.stdev(finals.values()) if len(finals) > 1 else 0.0
        mean = statistics.mean(finals.values())
        name = ("fp32 (torchft's own)" if codec == "fp32" and H > 1 else codec) + (
            f", {a.tags.get(tag, tag)}" if tag else "")
        many = len(finals) > 1
        lines.append(f"| {H} | {name} | {len(finals)} | {mean:.4f}"
                     + (f" ± {sd:.4f}" if many else "") + " | "
                     + (f"{statistics.mean(gaps):+.2f}% | "
                        + (f"{min(gaps):+.2f}% .. {max(gaps):+.2f}%" if many else "")
                        if gaps else " | ") + f" | {bps:,.0f} | "
                     + (f"1/{b0 / bps:.1f}" if b0 and bps else "") + " |")
        if not tag:
            points.append((H, codec, bps, mean, sd))
    report(lines, a.write)
    plot(points, a.out / "frontier.png")


def plot(points: list, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for codec, marker in (("fp32", "o"), ("int4", "s"), ("2bit", "^")):
        pts = sorted(p for p in points if p[1] == codec)
        if pts:
            ax.errorbar([p[2] for p in pts], [p[3] for p in pts], yerr=[p[4] for p in pts],
                        marker=marker, linestyle="none", label=codec, capsize=3)
            for H, _, x, y, _ in pts:
                ax.annotate(f"H={H}", (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("cross-node bytes per step (replica group 0)")
    ax.set_ylabel("final validation loss")
    ax.set_title("2 replica groups, gpt small, Shakespeare")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["run", "report"])
    p.add_argument("--out", type=Path, default=Path("runs/frontier"))
    p.add_argument("--model", default="small")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--only", default="", help="H:codec,... (default: every pair)")
    p.add_argument("--first", default="1:fp32,32:2bit,32:fp32",
                   help="pairs whose every seed runs before the other pairs' later seeds")
    p.add_argument("--tag", default="", help="run directories H<H>-<codec><tag>, e.g. -olr1")
    p.add_argument("--extra", default="", help="more `zeropp train` options for these runs")
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    a.tags = {"olr1m0": "outer lr 1, no momentum (averaging)",
              "olr04": "outer lr 0.4, Nesterov 0.9"}
    pairs = lambda s: [(int(x.split(":")[0]), x.split(":")[1]) for x in s.split(",") if x]  # noqa: E731
    a.seeds = [int(s) for s in a.seeds.split(",")]
    a.only = pairs(a.only) or ORDER
    a.first = pairs(a.first)
    (do_run if a.what == "run" else do_report)(a)


if __name__ == "__main__":
    main()
