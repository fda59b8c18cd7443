"""The same Hugging Face Trainer script under real DeepSpeed and under zeropp:
runs examples/hf/trainer_lm.py (a tiny GPT-2, `TrainingArguments(deepspeed=...)`)
twice under torchrun (2 ranks, CPU, fp32, seed 0): once with real DeepSpeed, from
a copy of the script (and of tiny.py) with its two zeropp lines (`import zeropp`,
`zeropp.install_as_deepspeed()`) removed, in DeepSpeed's own venv (`--ds-python`),
and once as written, in this interpreter's venv. Both get the same ds_config
(plain ZeRO-3, no ZeRO++ keys, torch's AdamW via `torch_adam: true`: DeepSpeed's
FusedAdam / CPUAdam need compiled ops; WarmupDecayLR; batch sizes, clipping and
hyperparameters "auto", i.e. from TrainingArguments). Compares rank 0's per-step
loss (the script's `losses [...]` line, full precision) and grad norm and learning
rate (Trainer's log_history, full precision, from the last checkpoint's
trainer_state.json). Residual differences (~1 float32 ulp) come from clipping: DeepSpeed
takes the grad norm in fp64, zeropp in fp32; with max_grad_norm=0 both are bit-equal.

    python benchmarks/conformance/hf_parity.py --steps 20 [--ds-python /tmp/dsvenv/bin/python] [--write PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HF = ROOT / "examples" / "hf"
ZEROPP_LINES = re.compile(r"^(import zeropp|zeropp\.install_as_deepspeed\(\)).*\n", re.M)
CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto", "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto", "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                          "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0,
                          "stage3_param_persistence_threshold": 0}}
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
PACKAGES = ("deepspeed", "torch", "transformers", "accelerate", "zeropp")
VERSIONS = (f"import importlib.metadata as m\nfor p in {PACKAGES!r}:\n"
            "    try: print(p, m.version(p))\n    except m.PackageNotFoundError: print(p, '-')")


def _versions(python: str) -> str:
    out = subprocess.run([python, "-c", VERSIONS], capture_output=True, text=True, check=True)
    return ", ".join(f"{p} {v}" for p, v in (ln.split(" ", 1) for ln in out.stdout.splitlines())
                     if v != "-")


def _run(python: str, script: Path, cfg: Path, out: Path, steps: int) -> dict:
    t = time.perf_counter()
    r = subprocess.run([python, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", str(script), "--out", str(out),
                        "--steps", str(steps), "--ds-config", str(cfg)],
                       capture_output=True, text=True, timeout=1800, cwd=out.parent,
                       env={**os.environ, **ENV})
    wall = time.perf_counter() - t
    m = re.search(r"^losses (\[.*\])$", r.stdout, re.M)
    state = out / f"checkpoint-{steps}" / "trainer_state.json"
    if r.returncode or not m or not state.exists():
        raise SystemExit(f"{script} under {python} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    hist = [h for h in json.loads(state.read_text())["log_history"] if "loss" in h]
    loss = json.loads(m.group(1))
    assert len(loss) == len(hist) == steps, (len(loss), len(hist), steps)
    rt = re.search(r"'train_runtime': '?([\d.]+)", r.stdout)
    return {"loss": loss, "grad_norm": [h["grad_norm"] for h in hist],
            "lr": [h["learning_rate"] for h in hist], "wall": wall,
            "train": float(rt.group(1)) if rt else float("nan")}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(a) if a else abs(b)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ds-python", default="/tmp/dsvenv/bin/python",
                   help="a Python with real DeepSpeed, torch, transformers, accelerate")
    p.add_argument("--write", default=None, metavar="PATH", help="write the markdown here")
    a = p.parse_args()
    if a.steps < 2:
        raise SystemExit("--steps must be >= 2 (the script checkpoints every steps // 2)")
    zp_python = str(Path(sys.executable))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = tmp / "ds_config.json"
        cfg.write_text(json.dumps(CONFIG, indent=1))
        (tmp / "ds_src").mkdir()
        ds_script = tmp / "ds_src" / "trainer_lm.py"
        ds_script.write_text(ZEROPP_LINES.sub("", (HF / "trainer_lm.py").read_text()))
        assert not re.search(r"^\s*(import zeropp|from zeropp|zeropp\.)", ds_script.read_text(),
                             re.M), "a zeropp line is left in the DeepSpeed copy"
        shutil.copy(HF / "tiny.py", tmp / "ds_src" / "tiny.py")
        print(f"DeepSpeed ({a.ds_python}) ...", end=" ", flush=True)
        ds = _run(a.ds_python, ds_script, cfg, tmp / "ds_out", a.steps)
        print(f"{ds['wall']:.1f} s; zeropp ({zp_python}) ...", end=" ", flush=True)
        zp = _run(zp_python, HF / "trainer_lm.py", cfg, tmp / "zp_out", a.steps)
        print(f"{zp['wall']:.1f} s", flush=True)
    rows = ["| step | DeepSpeed loss | zeropp loss | rel. diff | DeepSpeed grad_norm | "
            "zeropp grad_norm | rel. diff | learning rate (DeepSpeed / zeropp) |",
            "|---|---|---|---|---|---|---|---|"]
    rl, rg = [], []
    for i in range(a.steps):
        rl.append(_rel(ds["loss"][i], zp["loss"][i]))
        rg.append(_rel(ds["grad_norm"][i], zp["grad_norm"][i]))
        lr = (f"{ds['lr'][i]:.6g}" if ds["lr"][i] == zp["lr"][i]
              else f"{ds['lr'][i]:.9g} / {zp['lr'][i]:.9g}")
        rows.append(f"| {i + 1} | {ds['loss'][i]:.9f} | {zp['loss'][i]:.9f} | {rl[-1]:.1e} | "
                    f"{ds['grad_norm'][i]:.9f} | {zp['grad_norm'][i]:.9f} | {rg[-1]:.1e} | "
                    f"{lr} |")
    same = sum(x == y for x, y in zip(ds["loss"], zp["loss"]))
    lr_eq = ds["lr"] == zp["lr"]
    lines = [
        f"### Hugging Face Trainer, DeepSpeed vs zeropp ({time.strftime('%Y-%m-%d')})", "",
        f"Command: `python benchmarks/conformance/hf_parity.py {' '.join(sys.argv[1:])}`  ",
        f"examples/hf/trainer_lm.py under `python -m torch.distributed.run --nproc-per-node 2`"
        f" ({', '.join(f'{k}={v}' for k, v in ENV.items())}), {a.steps} steps, fp32, "
        "plain ZeRO-3 (`stage3_max_live_parameters`, `stage3_max_reuse_distance`, "
        "`stage3_param_persistence_threshold` 0), torch's AdamW (`torch_adam: true`), "
        "WarmupDecayLR, gradient clipping and hyperparameters `auto` (max_grad_norm 1.0, "
        "lr 3e-3, 2 warmup steps). Rank 0's loss (its own micro-batch) and global grad "
        "norm per step.", "",
        f"- DeepSpeed side: `{a.ds_python}`: {_versions(a.ds_python)}",
        f"- zeropp side: `{zp_python}`: {_versions(zp_python)}",
        f"- wall seconds (torchrun, incl. imports) DeepSpeed {ds['wall']:.1f}, zeropp "
        f"{zp['wall']:.1f}; Trainer train_runtime DeepSpeed {ds['train']:.2f}, zeropp "
        f"{zp['train']:.2f}", "",
        f"**Max relative loss difference: {max(rl):.1e}** (bit-equal on {same}/{a.steps} "
        f"steps); max relative grad-norm difference {max(rg):.1e}; learning rate equal "
        f"every step: {'yes' if lr_eq else 'no'}; target 1e-4: "
        f"{'met' if max(rl) <= 1e-4 else 'NOT met'}.", "", *rows]
    text = "\n".join(lines) + "\n"
    if a.write:
        Path(a.write).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
