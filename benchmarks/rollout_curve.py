"""The RLHF rollout example's reward curve over several seeds: runs
`examples/rollout.py` once per seed (4 ranks as 2 nodes x 2 on loopback),
plots every seed's mean reward per iteration, and reports the final reward
(mean of the last 5 iterations) as mean and spread over seeds.

    python benchmarks/rollout_curve.py --seeds 0,1,2 --iters 40 [--write]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import report

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--preset", default="zeropp")
    p.add_argument("--png", default=str(ROOT / "benchmarks" / "rollout_reward.png"))
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    logs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for s in seeds:
            out = Path(tmp) / f"seed{s}.jsonl"
            subprocess.run([sys.executable, str(ROOT / "examples" / "rollout.py"), "--seed",
                            str(s), "--iters", str(a.iters), "--preset", a.preset, "--out",
                            str(out)], check=True, capture_output=True, timeout=3600)
            logs[s] = [json.loads(line) for line in out.read_text().splitlines()]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for s, log in logs.items():
        ax.plot([r["iter"] for r in log], [r["mean_reward"] for r in log], label=f"seed {s}")
    ax.axhline(1 / 32, color="grey", lw=0.8, ls=":", label="chance (1/32)")
    ax.set_xlabel("iteration (rollouts under zeropp.gathered, then one update)")
    ax.set_ylabel("mean reward (share of target token)")
    ax.set_title(f"examples/rollout.py, {a.preset}, 4 ranks as 2x2", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.png, dpi=120)
    final = [statistics.mean(r["mean_reward"] for r in log[-5:]) for log in logs.values()]
    first = [statistics.mean(r["mean_reward"] for r in log[:3]) for log in logs.values()]
    half = [next((r["iter"] for r in log if r["mean_reward"] >= 0.5), None)
            for log in logs.values()]
    gen = [r["generate_bytes"] for log in logs.values() for r in log]
    report([f"### RLHF rollout example: reward curve ({time.strftime('%Y-%m-%d')})", "",
            f"Command: `python benchmarks/rollout_curve.py {' '.join(sys.argv[1:])}`  ",
            f"`examples/rollout.py` ({a.preset}, HF GPT-2 2x64, vocab 32, 4 ranks as 2 nodes x 2 "
            "on loopback, 8 rollouts of 8 new tokens per rank per iteration, sampled under "
            "`zeropp.gathered`, REINFORCE with the mean reward as baseline, Adam 3e-3). "
            f"Reward: share of generated tokens equal to the target token. Plot: "
            f"`benchmarks/{Path(a.png).name}`.", "",
            "| seeds | mean reward, first 3 iterations | mean reward, last 5 iterations | "
            "iterations to reach 0.5 | bytes rank 0 sent per rollout (min..max over iterations and seeds) |",
            "|---|---|---|---|---|",
            f"| {', '.join(map(str, seeds))} | {statistics.mean(first):.3f} "
            f"({min(first):.3f}..{max(first):.3f}) | {statistics.mean(final):.3f} "
            f"({min(final):.3f}..{max(final):.3f}) | {', '.join(str(h) for h in half)} | "
            f"{min(gen) / 1e3:.0f}..{max(gen) / 1e3:.0f} kB |"], a.write)


if __name__ == "__main__":
    main()
