"""Public DeepSpeed scripts, run UNMODIFIED on zeropp through `zeropp.install_as_deepspeed()`.

What it measures: whether third-party DeepSpeed training scripts run on zeropp as
published (their own `import deepspeed` lines, their own config built in code), with
the ZeRO++ keys merged over that config by `ZEROPP_DS_CONFIG`. For each run it reports
ran / failed (the first error line), what the script printed that shows training
(loss first -> last, test accuracy, checkpoint / resume lines, the per-rank
client_state check) and the wall time of the `torchrun` launch:

  cifar10_deepspeed.py   DeepSpeedExamples training/cifar/cifar10_deepspeed.py
                         (initialize with training_data, the engine's data loader,
                         WarmupLR, eval + test accuracy)
  train_bert_ds.py       DeepSpeedExamples training/HelloDeepSpeed/train_bert_ds.py:
                         a first run with checkpoints, a resume run from the
                         checkpoint's client_state, one run WITHOUT the override,
                         whose own config (ZeRO stage 1 + CPU optimizer offload) zeropp
                         refuses in one line (captured), and one with only the offload
                         turned off by the override (zeropp's stage-1 refusal)
  zero3_checkpoint_client_state.py
                         a script in DeepSpeed's unit-test style (SimpleModel, zero.Init,
                         GatheredParameters, per-rank client_state on save / load)

The third-party scripts are not vendored: by default the two DeepSpeedExamples files
are read from a local mirror of github.com/deepspeedai/DeepSpeedExamples at commit
45b4b7156c8794a3452a5a7d03dbd8d797068569 (or from a checkout given with --examples);
the report prints their origin and commit. The unit-style script is read from
--unit-script; if it was written with `import zeropp as deepspeed`, its imports are
turned back into DeepSpeed's (`import deepspeed`, `deepspeed.comm`, ...) in a temp copy,
so that the DeepSpeed import lines are what runs.

Two modes:

    # driver (default): launch every run under torchrun, print or write the report
    python benchmarks/conformance/public_scripts.py [--examples DIR] [--unit-script PATH] \\
        [--timeout 600] [--keep] [--write REPORT.md]

    # runner (what the driver's torchrun launches; usable by hand):
    torchrun --standalone --nproc-per-node 2 -- benchmarks/conformance/public_scripts.py \\
        --run path/to/script.py -- <the script's own arguments>

(the `--` after torchrun's options keeps torchrun's argparse from reading `--run` as
an ambiguous abbreviation of its `--run-path`.)

The runner calls `zeropp.install_as_deepspeed()`, installs the offline stand-ins
the script needs (benchmarks/conformance/public_scripts_standins.py), sets sys.argv and runs the
file with `runpy.run_path(path, run_name="__main__")`.

Runs use `torchrun --standalone --nproc-per-node 2`, OMP_NUM_THREADS=1,
HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1, each in a fresh working directory (not a git
repository), with a timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from public_scripts_standins import TAG

EXAMPLES_REPO = "github.com/deepspeedai/DeepSpeedExamples"
EXAMPLES_COMMIT = "45b4b7156c8794a3452a5a7d03dbd8d797068569"
EXAMPLE_FILES = {"cifar": "training/cifar/cifar10_deepspeed.py",
                 "bert": "training/HelloDeepSpeed/train_bert_ds.py"}
UNIT_DEFAULT = Path("/tmp/dsx/scripts/zero3_checkpoint_client_state.py")
ZEROPP_PLUS = {"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                     "zero_hpz_partition_size": 2,
                                     "zero_quantized_gradients": True,
                                     "offload_optimizer": {"device": "none"}}}
NO_OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "none"}}}
# The unit-style script reads its config file itself (dtype, zero.Init); plain ZeRO-3 here,
# the ZeRO++ keys come from ZEROPP_DS_CONFIG like for the other scripts.
UNIT_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
               "steps_per_print": 100,
               "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "betas": [0.8, 0.999],
                                                        "eps": 1e-8, "weight_decay": 3e-7}},
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
BERT_SIZE = ["--num_layers", "2", "--num_heads", "2", "--h_dim", "64", "--ff_dim", "128",
             "--max_seq_length", "64", "--batch_size", "8", "--num_iterations", "41",
             "--checkpoint_every", "20", "--log_every", "5", "--dtype", "bf16"]


def run_script(script: str, args: list[str]) -> None:
    import zeropp
    zeropp.install_as_deepspeed()  # before the stand-ins import transformers
    path = Path(script).resolve()
    from public_scripts_standins import install_standins  # after the alias
    used = install_standins(path)
    if os.environ.get("RANK", "0") == "0":
        print(f"{TAG} stand-ins: {'; '.join(used) or 'none'}", flush=True)
    sys.argv = [str(path), *args]
    sys.path[0] = str(path.parent)  # as `python script.py` would have it
    runpy.run_path(str(path), run_name="__main__")


# ================================================================ driver

def _mirror_dir() -> Path | None:
    for top in sorted(Path("/work/.mirror").glob("*DeepSpeedExamples*")):
        for gd in (top, *sorted(d for d in top.iterdir() if d.is_dir())):
            if (gd / "HEAD").is_file() and subprocess.run(
                    ["git", "--git-dir", str(gd), "cat-file", "-e", EXAMPLES_COMMIT],
                    capture_output=True).returncode == 0:
                return gd
    return None


def examples(arg: str | None, work: Path) -> tuple[dict[str, Path], str]:
    if arg:
        arg = str(Path(arg).resolve())
        paths = {k: Path(arg) / v for k, v in EXAMPLE_FILES.items()}
        rev = subprocess.run(["git", "-C", arg, "rev-parse", "HEAD"], capture_output=True,
                             text=True).stdout.strip() or "unknown (not a git checkout)"
        return paths, f"{EXAMPLES_REPO} checkout {arg}, commit {rev}"
    gd = _mirror_dir()
    if gd is None:
        raise SystemExit(f"no DeepSpeedExamples mirror with {EXAMPLES_COMMIT} found under "
                         "/work/.mirror; pass --examples <a DeepSpeedExamples checkout>")
    paths = {}
    for key, rel in EXAMPLE_FILES.items():
        out = work / "examples" / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(subprocess.run(["git", "--git-dir", str(gd), "show",
                                        f"{EXAMPLES_COMMIT}:{rel}"], check=True,
                                       capture_output=True).stdout)
        paths[key] = out
    return paths, f"{EXAMPLES_REPO} at {EXAMPLES_COMMIT} (from the mirror {gd})"


def unit_script(path: Path, work: Path) -> tuple[Path, str]:
    text = path.read_text()
    if not re.search(r"^\s*(?:import|from)\s+zeropp\b", text, re.M):
        return path, f"{path} (as is)"
    variant = path.parent.parent / "ds_variants" / path.name
    if variant.is_file():
        return variant, f"{variant} (the deepspeed-import variant of {path})"
    out = work / "unit" / path.name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(re.sub(r"^(\s*(?:import|from)\s+)zeropp\b", r"\1deepspeed", text, flags=re.M))
    return out, f"{path} with its `zeropp` imports turned into `deepspeed` ({out})"


ERROR = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b(?::.*)?$")
RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:\s?")  # torchrun's prefix on a rank's stderr


def _error_at(lines: list[str]) -> int | None:
    """Index of the first exception line a rank printed (not torchrun's own)."""
    for i, ln in enumerate(lines):
        ln = RANK_PREFIX.sub("", ln)
        if ERROR.match(ln) and "ChildFailedError" not in ln:
            return i
    return None


def first_error(log: str) -> str:
    lines = log.splitlines()
    i = _error_at(lines)
    if i is not None:
        return RANK_PREFIX.sub("", lines[i]).strip()
    return next((ln.strip() for ln in reversed(lines) if ln.strip()), "(no output)")


def traceback_tail(log: str, n: int = 12) -> str:
    """The last n lines of the traceback that ends in the first error line, from that
    rank's lines only."""
    lines = log.splitlines()
    i = _error_at(lines)
    if i is None:
        return "\n".join(lines[-n:])
    m = RANK_PREFIX.match(lines[i])
    same = [ln for ln in lines[:i + 1] if (RANK_PREFIX.match(ln) or [None, None])[1]
            == (m.group(1) if m else None)]
    same = [RANK_PREFIX.sub("", ln) for ln in same]
    start = max((j for j, ln in enumerate(same) if ln.startswith("Traceback")), default=0)
    return "\n".join(same[max(start, len(same) - n):])


def launch(name: str, script: Path, args: list[str], cwd: Path, override: dict | None,
           timeout: int, logs: Path) -> dict:
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node",
           "2", "--", str(Path(__file__).resolve()), "--run", str(script), "--", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("ZEROPP_DS_CONFIG", None)
    if override is not None:
        env["ZEROPP_DS_CONFIG"] = json.dumps(override)
    cwd.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        out, rc = out + f"\nTimeoutError: no exit after {timeout} s (killed)\n", -9
    wall = time.time() - t0
    log = logs / f"{name}.log"
    log.write_text(out)
    shell = (f"cd {cwd} && " + ("ZEROPP_DS_CONFIG='" + json.dumps(override) + "' "
                                if override is not None else "")
             + "OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 " + " ".join(cmd))
    print(f"{TAG} {name}: rc {rc}, {wall:.1f} s, log {log}", file=sys.stderr, flush=True)
    standins = re.search(rf"^{re.escape(TAG)} stand-ins: (.*)$", out, re.M)
    return {"name": name, "rc": rc, "out": out, "wall": wall, "cmd": shell, "log": str(log),
            "override": override, "standins": standins.group(1) if standins else "?"}


NUM = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))"  # ranks' prints can run together


def _floats(pattern: str, text: str) -> list[float]:
    return [float(m) for m in re.findall(pattern.replace("(NUM)", NUM), text, re.M)]


def _safe(fn, *args) -> tuple[bool, str]:
    """An evidence parser's answer, or why it had none (the run still gets its row)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a report row, not a crash
        return False, f"(could not read the output: {type(e).__name__}: {e})"


def evidence_unit(r: dict) -> tuple[bool, str]:
    ok = re.findall(r"\[rank (\d+)\] OK: (\d+) steps, first loss ([^,\s]+), last loss ([^,\s]+), "
                    r"client_state rank_value=(\d+) rank_tensor=(\[[^\]]*\]), "
                    r"global_steps=(\d+)", r["out"])
    parts = [f"rank {rk}: {n} steps, loss {a} -> {b}, client_state "
             f"rank_value={rv} rank_tensor={rt}, global_steps={gs}"
             for rk, n, a, b, rv, rt, gs in sorted(ok)]
    good = r["rc"] == 0 and {rk for rk, *_ in ok} == {"0", "1"} \
        and all(rk == rv for rk, _, _, _, rv, _, _ in ok)
    if good:
        parts.append("per-rank client_state back on each rank; reloaded parameters equal; "
                     "one more step gives equal losses")
    return good, "; ".join(parts)


def evidence_cifar(r: dict) -> tuple[bool, str]:
    losses = _floats(r"\[\s*\d+,\s+\d+\] loss:\s+(NUM)", r["out"])
    acc = re.search(r"Accuracy of the network on the (\d+) test images:\s*(\S+) %", r["out"])
    parts = []
    if losses:
        parts.append(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} ({len(losses)} log lines)")
    if acc:
        parts.append(f"test accuracy {acc.group(2)} % on {acc.group(1)} images")
    good = r["rc"] == 0 and "Finished Training" in r["out"] and acc is not None
    return good, "; ".join(parts)


def checkpoint_tags(exp: Path | None) -> str:
    if exp is None or not exp.is_dir():
        return "no experiment directory"
    tags = sorted((d.name for d in exp.iterdir() if d.is_dir() and d.name != "tb_dir"),
                  key=lambda s: (len(s), s))
    latest = (exp / "latest").read_text().strip() if (exp / "latest").is_file() else None
    files = {t: len(list((exp / t).iterdir())) for t in tags}
    return ("tags " + ", ".join(f"{t} ({files[t]} files)" for t in tags)
            + (f", latest={latest}" if latest else ", no 'latest' file"))


def evidence_bert(r: dict, exp: Path | None) -> tuple[bool, str]:
    losses = _floats(r"Loss: (NUM)", r["out"])
    saves = len(re.findall(r"Saved model to ", r["out"]))
    parts = []
    if losses:
        parts.append(f"running-mean loss {losses[0]:.4f} -> {losses[-1]:.4f} "
                     f"({len(losses)} log lines)")
    count = re.search(r"Total number of model parameters: (\S+)", r["out"])
    if count:
        parts.append(f"'Total number of model parameters: {count.group(1)}'")
    parts.append(f"{saves} 'Saved model' lines; {checkpoint_tags(exp)}")
    return r["rc"] == 0 and saves > 0 and bool(losses), "; ".join(parts)


def run_all(a: argparse.Namespace, work: Path) -> tuple[list[dict], dict]:
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ex, ex_origin = examples(a.examples, work)
    unit_path = Path(a.unit_script).resolve()
    # The unit-test-style script is not part of this repository (composed from
    # DeepSpeed's tests/unit helpers): its row runs only where a copy is given.
    unit, unit_origin = unit_script(unit_path, work) if unit_path.is_file() else (None, "absent")
    cfg = work / "ds_config_zero3_unit.json"
    cfg.write_text(json.dumps(UNIT_CONFIG, indent=2))
    rows = []

    def add(label, res, good, ev, expect_fail=False):
        if expect_fail:
            status = "refused (expected)" if res["rc"] != 0 else "RAN (a refusal was expected)"
        else:
            status = "ran" if good else ("timed out" if res["rc"] == -9 else "FAILED")
        err = first_error(res["out"]) if res["rc"] != 0 else ""
        rows.append({**res, "label": label, "status": status, "evidence": ev, "error": err,
                     "good": good if not expect_fail else res["rc"] != 0})

    if unit is not None:
        r = launch("unit", unit, ["--deepspeed_config", str(cfg), "--tmpdir",
                                  str(work / "ckpt_unit")],
                   work / "run_unit", ZEROPP_PLUS, a.timeout, logs)
        add(Path(a.unit_script).name, r, *_safe(evidence_unit, r))

    r = launch("cifar", ex["cifar"], ["--deepspeed", "--stage", "3", "--dtype", "fp32", "-e", "5",
                                      "--log-interval", "8"],
               work / "run_cifar", ZEROPP_PLUS, a.timeout, logs)
    add("cifar10_deepspeed.py", r, *_safe(evidence_cifar, r))

    bert_cwd = work / "run_bert"
    r = launch("bert", ex["bert"], ["--checkpoint_dir", str(work / "bert_exp"), *BERT_SIZE],
               bert_cwd, ZEROPP_PLUS, a.timeout, logs)
    m = re.search(r"Experiment Directory created at (\S+)", r["out"])
    exp = Path(m.group(1)) if m else None
    latest = exp / "latest" if exp is not None else None
    before = latest.read_text().strip() if latest is not None and latest.is_file() else "?"
    add("train_bert_ds.py (first run)", r, *_safe(evidence_bert, r, exp))

    if exp is not None and exp.is_dir():
        r = launch("bert_resume", ex["bert"], ["--load_checkpoint_dir", str(exp),
                                               "--num_iterations", "61"],
                   bert_cwd, ZEROPP_PLUS, a.timeout, logs)
        good, ev = _safe(evidence_bert, r, exp)
        first = _floats(r"Loss: (NUM)", rows[-1]["out"])[:1]
        again = _floats(r"Loss: (NUM)", r["out"])[:1]
        if first and again:
            ev += (f"; resumed loss starts {'below' if again[0] < first[0] else 'NOT below'} "
                   f"the first run's {first[0]:.4f}")
        add("train_bert_ds.py (resume)", r, good, f"loads `latest`={before}; {ev}")
    else:
        rows.append({"label": "train_bert_ds.py (resume)", "status": "not run",
                     "evidence": "the first run made no experiment directory", "error": "",
                     "wall": 0.0, "cmd": "", "override": ZEROPP_PLUS, "good": False, "out": "",
                     "log": "", "standins": ""})

    for name, label, over, note in (
            ("bert_own_config", "its own config: ZeRO-1 + CPU offload", None,
             "no ZEROPP_DS_CONFIG: zeropp's refusal"),
            ("bert_stage1", "its own ZeRO-1, offload \"none\" by override", NO_OFFLOAD,
             "ZeRO-1 without offload: zeropp's stage refusal")):
        r = launch(name, ex["bert"], ["--checkpoint_dir", str(work / f"{name}_exp"), *BERT_SIZE],
                   work / f"run_{name}", over, a.timeout, logs)
        add(f"train_bert_ds.py ({label})", r, False, note, expect_fail=True)
    return rows, {"examples": ex_origin, "unit": unit_origin, "work": str(work)}


def report(rows: list[dict], info: dict, total: float) -> str:
    import torch
    L = ["## Public DeepSpeed scripts, unmodified, on zeropp (`install_as_deepspeed`)", "",
         f"Scripts: {info['examples']}; unit-test-style script: {info['unit']}. "
         f"torch {torch.__version__}, 2 ranks (`torchrun --standalone --nproc-per-node 2`), "
         f"{'CUDA' if torch.cuda.is_available() else 'CPU, gloo'}. "
         f"ZeRO++ keys by `ZEROPP_DS_CONFIG={json.dumps(ZEROPP_PLUS)}`.", "",
         "| script | config | result | what it printed | wall s |", "|---|---|---|---|---|"]
    for r in rows:
        res = r["status"] + (f": `{r['error']}`" if r["error"] else "")
        conf = ("script's + ZeRO++ override" if r["override"] == ZEROPP_PLUS else
                "script's own" if r["override"] is None else
                f"script's + `{json.dumps(r['override'])}`")
        L.append(f"| {r['label']} | {conf} | {res} | {r['evidence']} | {r['wall']:.1f} |")
    L += ["", f"Total {total:.0f} s.", "", "Commands (the driver's launches):", "", "```"]
    L += [r["cmd"] for r in rows if r["cmd"]] + ["```", "", "Notes:", ""]
    seen = {}
    for r in rows:
        if r["standins"]:
            seen.setdefault(r["label"].split(" ")[0], r["standins"])
    L += [f"- Offline stand-ins installed (rank 0's line), {k}: {v}" for k, v in seen.items()]
    L += ["- The scripts are run as published; nothing in them is edited (the unit-style "
          "script only has its `zeropp` imports turned back into `deepspeed`).",
          "- train_bert_ds builds its config in code (ZeRO stage 1, offload_optimizer cpu); "
          "the override's stage 3 and offload device \"none\" replace those keys.",
          "- train_bert_ds's 'Total number of model parameters' is `sum(p.numel() for p in "
          "model.parameters())` through the engine: under ZeRO-3 that counts what a rank holds "
          "(zeropp: the rank's flat fp32 master shards; DeepSpeed ZeRO-3: 0-element partitioned "
          "parameters), not the model size (DeepSpeed's ZeRO-1 run prints the full count).",
          "- zero3_checkpoint_client_state's compare_model_states gathers and compares "
          "`engine.module.named_parameters()`; with zeropp these are the flat fp32 master shards "
          "(one per unit), so it compares each rank's shard of the two engines rather than "
          "full-shape parameters (the module attributes, e.g. `linears[0].weight`, do gather "
          "to full shape).",
          f"- Logs and checkpoints: {info['work']}" + (" (removed; --keep keeps them)"
                                                      if not info.get("keep") else "")]
    bad = [r for r in rows if not r["good"] and r["out"]]
    if bad:
        L += ["", "Failures (traceback tails):", ""]
        for r in bad:
            L += [f"{r['label']}:", "", "```", traceback_tail(r["out"]), "```", ""]
    return "\n".join(L).rstrip() + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--run":
        if len(sys.argv) < 3:
            raise SystemExit("usage: public_scripts.py --run SCRIPT -- ARGS...")
        rest = sys.argv[3:]
        return run_script(sys.argv[2], rest[1:] if rest[:1] == ["--"] else rest)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", help="a DeepSpeedExamples checkout (default: the mirror at "
                                      f"{EXAMPLES_COMMIT[:12]})")
    p.add_argument("--unit-script", default=str(UNIT_DEFAULT))
    p.add_argument("--timeout", type=int, default=600, help="seconds per launch")
    p.add_argument("--workdir", help="where runs, logs and checkpoints go (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument("--write", metavar="PATH", help="write the markdown report here")
    a = p.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="zeropp_public_scripts_")).resolve()
    t0 = time.time()
    rows, info = run_all(a, work)
    info["keep"] = a.keep or bool(a.workdir)
    text = report(rows, info, time.time() - t0)
    if a.write:
        Path(a.write).write_text(text)
        print(f"{TAG} report written to {a.write}", file=sys.stderr)
    else:
        print(text)
    if not info["keep"]:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if all(r["good"] for r in rows) else 1)


if __name__ == "__main__":
    main()
