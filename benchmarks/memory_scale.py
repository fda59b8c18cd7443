"""Per-rank memory at real model sizes: zeropp's presets against PyTorch FSDP2 and
DeepSpeed ZeRO-3 in one run, W=4 ranks (2 nodes x 2 on loopback), an HF model built
from its config (no hub), AdamW, batch 1 x T, a few steps.

Each configuration is one `torchrun` of benchmarks/_memory_worker.py (DeepSpeed's
under `--ds-python`, a Python with deepspeed installed); the peak is the largest
rank's resident high-water mark (VmHWM) above its RSS before the model is built.
Beside it: the ZeRO-3 formula, 16 bytes/param / W (fp32 master, gradient, two AdamW
moments), plus the activations forward saves (measured once, unsharded, with
saved-tensor hooks), and the ratio of the peak to that sum; and the ratio to the
sum with the largest unit's full weights added (ZeRO-3's "one unit gathered": at
GPT-2 that is the root, whose tied embedding is 15% of the model). "after trim" is
the RSS after the steps once glibc hands back every free page it can: the gap to
"after steps" is freed memory the allocator kept.

`+malloc` rows run FSDP2 / DeepSpeed with the glibc setting zeropp makes for a CPU
model of this size (MALLOC_MMAP_THRESHOLD_ = zeropp.host_memory.mmap_threshold_for: none below
100M parameters, 128 KiB from 100M; freed buffers go back to the OS), so the frameworks
are compared with equal allocators too.

    python benchmarks/memory_scale.py --model gpt2-355m \\
        --configs zero3,zeropp,zeropp-plus,fsdp2,fsdp2+malloc,deepspeed,deepspeed+malloc [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _report import report

from zeropp.host_memory import mmap_threshold_for

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "_memory_worker.py"


def malloc_env(params: int) -> dict:
    """The environment giving another framework the glibc setting zeropp makes for a
    CPU model of `params` parameters (zeropp.host_memory.mmap_threshold_for)."""
    threshold = mmap_threshold_for(params)
    return {} if threshold is None else {"MALLOC_MMAP_THRESHOLD_": str(threshold)}


def run_worker(python: str, nproc: int, args: list[str], env: dict, timeout: int = 3000) -> dict:
    """One torchrun of the worker; its RESULT, or {"error": the output's tail}."""
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), str(WORKER), *args]
    if "unsharded" in args:  # one process, no process group
        cmd = [python, str(WORKER), *args]
    e = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu",
         "PYTHONPATH": str(ROOT / "src"), **env}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e,
                           cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
    return {"error": " / ".join(tail)[-300:] or f"exit {r.returncode}"}


def config_run(config: str, model: str, init: str, steps: int, tokens: int, ds_python: str,
               params: int, nproc: int = 4) -> dict:
    framework, _, variant = config.partition("+")
    framework, _, option = framework.partition("[")  # zero3[async_reduce=0]: one Config field
    python = ds_python if framework == "deepspeed" else sys.executable
    env = malloc_env(params) if variant == "malloc" else {}
    extra = ["--zeropp-option", option.rstrip("]")] if option else []
    return run_worker(python, nproc, ["--model", model, "--framework", framework, "--init", init,
                                      "--steps", str(steps), "--tokens", str(tokens), *extra], env)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2-355m")
    p.add_argument("--configs",
                   default="zero3,zeropp,zeropp-plus,fsdp2,fsdp2+malloc,deepspeed,deepspeed+malloc")
    p.add_argument("--init", default="sharded", choices=["sharded", "whole"])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--ds-python", default="/tmp/dsvenv/bin/python")
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    act = run_worker(sys.executable, 1, ["--model", a.model, "--framework", "unsharded",
                                         "--tokens", str(a.tokens), "--activations"], {})
    if "error" in act:
        raise SystemExit(f"measuring activations failed: {act['error']}")
    params, acts, unit = act["params"], act["activations_mb"], act["unit_mb"]
    formula = 16 * params / 4 / 2**20
    rows = ["| config | peak MB (max rank) | / (formula + activations) | / (formula + unit + "
            "activations) | rank 0 peak in forward / backward / step MB | peak building MB | "
            "after steps MB | after trim MB | tensors held MB (rank 0) | gathered peak MB | "
            "losses | s/step |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for config in a.configs.split(","):
        r = config_run(config, a.model, a.init, a.steps, a.tokens, a.ds_python, params)
        if "error" in r:
            rows.append(f"| {config} | failed: {r['error']} | | | | | | | | | | |")
        else:
            ranks = r["ranks"]
            peak = max(x["peak"] for x in ranks)
            st = ranks[0].get("stats")
            held = f"{st['total']:.0f}" if st else "-"
            gathered = f"{st['gathered_peak']:.0f}" if st else "-"
            losses = " ".join(f"{v:.3f}" for v in ranks[0]["losses"])
            ph = ranks[0]["phases"]
            rows.append(f"| {config} | {peak:.0f} | {peak / (formula + acts):.2f} | "
                        f"{peak / (formula + unit + acts):.2f} | "
                        f"{ph['forward']:.0f} / {ph['backward']:.0f} / {ph['step']:.0f} | "
                        f"{max(x['peak_built'] for x in ranks):.0f} | "
                        f"{max(x['after'] for x in ranks):.0f} | "
                        f"{max(x['after_trim'] for x in ranks):.0f} | {held} | {gathered} | "
                        f"{losses} | {ranks[0]['s_per_step']:.1f} |")
        print(rows[-1], flush=True)
    head = (f"HF {a.model} ({params / 1e6:.1f}M params), W=4 as 2 nodes x 2 (loopback), fp32, "
            f"AdamW, batch 1x{a.tokens}, {a.steps} steps, init `{a.init}`; ZeRO-3 formula "
            f"16 B/param / W = {formula:.0f} MB; activations saved by forward (unsharded, "
            f"measured) {acts:.0f} MB; formula + activations = {formula + acts:.0f} MB; the "
            f"largest unit's full weights (ZeRO-3 holds one gathered) {unit:.0f} MB; formula + "
            f"unit + activations = {formula + unit + acts:.0f} MB")
    cmd = "python benchmarks/memory_scale.py " + " ".join(sys.argv[1:])
    report([f"### Memory at scale: {a.model}, init {a.init} ({time.strftime('%Y-%m-%d')})", "",
            f"Command: `{cmd}`  ", head + ".", "", *rows], a.write)


if __name__ == "__main__":
    main()
