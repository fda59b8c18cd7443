"""The largest model that trains here: TinyLlama-1.1B's shape (width 2048, GQA 32/4
heads, MLP 5632, vocabulary 32000, untied head) at increasing depth, fp32 masters
and compute, AdamW, 3 steps on one fixed batch of 1 x 64 tokens, W=4 ranks as 2 x 2
(zeropp's ZeRO-3, FSDP2, DeepSpeed ZeRO-3) against one unsharded process.

[Note: the budget]
The four ranks share this machine's memory, so a sharded run can never hold more
in total than one process could: what ZeRO promises is per device. Each process
here stands for a device with a budget of `--budget-mb` (default 5632 MB: this
machine's 23 GiB over 4, less room for the OS); a run *fits* when every rank's
resident high-water mark (VmHWM, absolute, torch included) stays within it, and
*trains* when it fits and its 3 losses are finite and fall. The budget is checked,
not enforced: every run finishes and its peak is reported.

Each framework walks the depths from `--start`: up while it trains, down while it
does not; the table lists every run made.

    python benchmarks/largest_model.py [--frameworks zero3,fsdp2,deepspeed,unsharded] [--write]
"""

from __future__ import annotations

import argparse
import sys
import time

from _report import report
from memory_scale import malloc_env, run_worker

DEPTHS = [1, 2, 3, 4, 6, 8, 12, 16, 18, 20, 22, 24]
START = {"unsharded": 3, "zero3": 16, "fsdp2": 16, "deepspeed": 8}


def params_of(depth: int) -> int:
    d, v, f, kv = 2048, 32000, 5632, 2048 * 4 // 32
    return 2 * v * d + d + depth * (2 * d * d + 2 * d * kv + 3 * d * f + 2 * d)


def trial(framework: str, depth: int, a) -> dict:
    python = a.ds_python if framework == "deepspeed" else sys.executable
    nproc = 1 if framework == "unsharded" else 4
    env = malloc_env(params_of(depth)) if framework in ("fsdp2", "deepspeed", "unsharded") else {}
    r = run_worker(python, nproc, ["--model", f"llama:{depth}", "--framework", framework,
                                   "--steps", "3", "--tokens", "64", "--same-batch"], env,
                   timeout=1500)
    out = {"framework": framework, "depth": depth, "params": params_of(depth)}
    if "error" in r:
        return {**out, "ok": False, "why": r["error"]}
    ranks = r["ranks"]
    peak = max(x["base"] + x["peak"] for x in ranks)
    losses = ranks[0]["losses"]
    falls = r["finite"] and losses[-1] < losses[0]
    fits = peak <= a.budget_mb
    why = "" if fits and falls else ("over budget" if not fits else "loss did not fall")
    return {**out, "ok": fits and falls, "peak": peak, "losses": losses, "why": why,
            "s_per_step": ranks[0]["s_per_step"]}


def walk(framework: str, a) -> list[dict]:
    i = DEPTHS.index(a.start.get(framework, START[framework]))
    runs = [trial(framework, DEPTHS[i], a)]
    step = 1 if runs[0]["ok"] else -1
    while 0 <= i + step < len(DEPTHS):
        i += step
        runs.append(trial(framework, DEPTHS[i], a))
        print(runs[-1], flush=True)
        if runs[-1]["ok"] != (step == 1):
            break
    return runs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--frameworks", default="zero3,fsdp2,deepspeed,unsharded")
    p.add_argument("--budget-mb", type=float, default=5632)
    p.add_argument("--start", default="", help="e.g. zero3=16,unsharded=4")
    p.add_argument("--ds-python", default="/tmp/dsvenv/bin/python")
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    a.start = {k: int(v) for k, v in (s.split("=") for s in a.start.split(",") if s)}
    rows = ["| framework | layers | params | peak MB (max rank, absolute) | losses (3 steps) | "
            "s/step | trains within budget |", "|---|---|---|---|---|---|---|"]
    best = {}
    for fw in a.frameworks.split(","):
        for r in sorted(walk(fw, a), key=lambda r: r["depth"]):
            peak = f"{r['peak']:.0f}" if "peak" in r else "-"
            losses = " ".join(f"{v:.3f}" for v in r.get("losses", []))
            sps = f"{r['s_per_step']:.0f}" if "s_per_step" in r else "-"
            rows.append(f"| {fw} | {r['depth']} | {r['params'] / 1e6:.0f}M | {peak} | "
                        f"{losses} | {sps} | {'yes' if r['ok'] else 'no: ' + r['why']} |")
            if r["ok"]:
                best[fw] = max(best.get(fw, 0), r["params"])
    summary = ", ".join(f"{fw} {n / 1e6:.0f}M" for fw, n in best.items())
    if "unsharded" in best:
        summary += "; " + ", ".join(f"{fw} {n / best['unsharded']:.1f}x unsharded"
                                    for fw, n in best.items() if fw != "unsharded")
    cmd = "python benchmarks/largest_model.py " + " ".join(sys.argv[1:])
    report([f"### The largest model that trains (budget {a.budget_mb:.0f} MB per process, "
            f"{time.strftime('%Y-%m-%d')})", "", f"Command: `{cmd}`  ",
            "TinyLlama-1.1B's shape at increasing depth, fp32, AdamW, 3 steps on one batch "
            "of 1x64, W=4 as 2x2 (one process for `unsharded`); sharded init everywhere "
            "(zeropp.deferred_init, FSDP2 meta + to_empty, DeepSpeed zero.Init); FSDP2, "
            "DeepSpeed and the unsharded process with the mmap-threshold setting zeropp "
            f"makes. Largest that trains: {summary}.", "", *rows], a.write)


if __name__ == "__main__":
    main()
