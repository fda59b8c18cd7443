"""`zeropp train`: the main job (also `python -m zeropp train`; across machines,
`torchrun ... -m zeropp.train` with the same options, see train/__main__.py), and
`zeropp plan`: the cost model of each configuration on a cluster you describe.

Bad input ends in one line on stderr and exit status 2, before any worker starts;
so does a run directory another live `zeropp train` owns (train/lock.py), and a
checkpoint to resume from that does not verify. A run directory given to
`--out` that already holds checkpoints is resumed (one line says so), never
started again over its metrics. A crash after the restarts ends in one line
and the path of RUN/failures.log, which holds every attempt's tracebacks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

import zeropp

from ..checkpoint_files import CheckpointError, read_manifest
from ..config import NAMED, SWITCHES, is_named, named
from ..train.data import DataError
from ..train.lock import RunLock, RunLocked
from ..train.loop import TrainArgs, prepare_tokens, train_worker
from ..train.model import PRESETS
from ..train.report import plot, summarize, table
from ..train.resume import (
    candidates,
    check_same_config,
    check_same_run,
    resume_point,
    run_dir_of,
)
from ..train.resume import find as find_checkpoint
from ..train.tokenizer import TokenizerError
from .commands import DTYPES, UsageError, make_dir, run_bench_cmd, run_export, run_launch, run_plan
from .launch import WorkerError, spawn
from .replicas import add_replica_args, refuse_unused, run_replica_train

CACHE = Path.home() / ".cache" / "zeropp"


# The preset `zeropp train` runs unless told otherwise: chosen by the 3-seed
# accuracy measurement in benchmarks/RESULTS.md.
DEFAULT_PRESET = "zeropp-plus"
_SWITCH_FLAGS = [  # (flag, Config field, help): each overrides the preset
    ("qwz", "quantized_weights", "quantized (INT8) weight all-gather"),
    ("qgz", "quantized_gradients", "hierarchical quantized gradient reduce-scatter"),
    ("hier", "hierarchical_gather", "two-stage weight gather: across nodes, then inside"),
    ("qwd", "weight_delta", "refresh hpZ copies by INT4 weight deltas"),
    ("ef", "gradient_error_feedback", "error feedback on the inter-node gradient hop"),
]
_OVERRIDES = [f for _, f, _ in _SWITCH_FLAGS] + [
    "hpz_partition_size", "quantized_nontrainable_weights", "grad_bits",
    "intra_node_grad_bits", "block_size"]


def add_train_args(p: argparse.ArgumentParser) -> None:
    d = TrainArgs()
    g = p.add_argument_group("launch")
    g.add_argument("--nproc", type=int, default=4, help="ranks on this machine (default 4)")
    g.add_argument("--node-size", type=int, default=2,
                   help="ranks per (emulated) node; ranks are node-major (default 2)")
    g.add_argument("--out", default=None, help="run directory (default runs/<time>)")
    g.add_argument("--max-restarts", type=int, default=0,
                   help="restart all workers up to N times after a crash, resuming from the "
                        "last checkpoint (as torchrun's --max-restarts)")
    g.add_argument("--verbose", action="store_true",
                   help="restart lines carry the failing rank's last message line (gloo's)")
    add_replica_args(p)
    g = p.add_argument_group("checkpoints")
    g.add_argument("--save-every", type=int, default=d.save_every,
                   help=f"steps between checkpoints in RUN/checkpoints (0: only the last; "
                        f"default {d.save_every})")
    g.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    g.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from a checkpoint, or from a run directory's newest one "
                        "that verifies (model, optimizer, LR schedule, data position, RNG); "
                        "--out on a directory holding a run resumes it too")
    g = p.add_argument_group("data and model")
    g.add_argument("--data", default=None, help="a UTF-8 text file (default: Shakespeare)")
    g.add_argument("--tokenizer", default=d.tokenizer, choices=["bytes", "bpe"])
    g.add_argument("--model", default=d.model, help=f"preset: {', '.join(PRESETS)}")
    g.add_argument("--hf-model", default=None, choices=["gpt2", "llama"],
                   help="a transformers model of the preset's size, built offline")
    g = p.add_argument_group("optimization")
    for name in ("steps", "batch", "seq_len", "accum", "warmup", "seed", "eval_every",
                 "eval_batches", "log_every"):
        g.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("lr", "min_lr_ratio", "weight_decay", "clip"):
        g.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    g = p.add_argument_group(f"ZeRO++ (default: the {DEFAULT_PRESET} preset; flags override it)")
    g.add_argument("--preset", default=DEFAULT_PRESET,
                   help=f"named configuration: {', '.join(NAMED)} (NAME~SWITCH flips one)")
    for flag, field, what in _SWITCH_FLAGS:
        g.add_argument(f"--{flag}", dest=field, action=argparse.BooleanOptionalAction,
                       default=None, help=what)
    g.add_argument("--hpz", dest="hpz_partition_size", type=int, default=None,
                   help="hpZ partition size (the node size normally, 1 = off)")
    g.add_argument("--quantized-nontrainable", dest="quantized_nontrainable_weights",
                   action="store_true", default=None)
    g.add_argument("--grad-bits", dest="grad_bits", type=int, default=None)
    g.add_argument("--intra-grad-bits", dest="intra_node_grad_bits", type=int, default=None)
    g.add_argument("--block-size", dest="block_size", type=int, default=None)
    g.add_argument("--param-dtype", default=None, choices=list(DTYPES),
                   help="compute dtype (fp32 default: bf16 matmul is ~150x slower on "
                        "CPUs without bf16 units)")
    g.add_argument("--deepspeed-config", default=None, metavar="FILE",
                   help="read the ZeRO++ switches and dtype from a DeepSpeed JSON config")
    g.add_argument("--compare", default=None, metavar="NAMES",
                   help=f"run these one after another and plot them together: "
                        f"{','.join(NAMED)}")


def configs_from(ns: argparse.Namespace) -> list[tuple[str, zeropp.Config]]:
    """(name, Config) for each run the options ask for; raises UsageError."""
    try:
        given = {k: getattr(ns, k) for k in _OVERRIDES if getattr(ns, k) is not None}
        if ns.param_dtype or not ns.deepspeed_config:  # (else the config's dtype)
            given["param_dtype"] = DTYPES[ns.param_dtype or "fp32"]
        names = [c.strip() for c in (ns.compare or ns.preset).split(",") if c.strip()]
        bad = [c for c in names if not is_named(c)]
        if bad or not names:
            flag = "--compare" if ns.compare else "--preset"
            raise UsageError(f"{flag}: unknown configuration {bad[0] if bad else ''!r}; "
                             f"choose from {', '.join(NAMED)} (optionally with ~SWITCH "
                             f"flips: {', '.join(SWITCHES)})")
        if ns.deepspeed_config:
            if ns.compare or ns.preset != DEFAULT_PRESET:  # (it was silently ignored)
                raise UsageError("--deepspeed-config is the one configuration to run; it "
                                 "cannot be combined with --compare or --preset")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                cfg = zeropp.Config.from_deepspeed(ns.deepspeed_config, node_size=ns.node_size)
            for w in caught:
                print(f"zeropp train: warning: {w.message}", file=sys.stderr)
            runs = [("run", cfg.replace(**given))]  # the flags override it, as a preset
        else:
            runs = [(c, named(c, ns.node_size, **given)) for c in names]
        world = ns.nproc // max(1, ns.replicas)  # (a replica group's ranks)
        for _, cfg in runs:  # (--hpz, a preset or a DeepSpeed config's)
            if world % cfg.hpz_partition_size:
                raise UsageError(f"hpZ's partition size {cfg.hpz_partition_size} must divide "
                                 f"the {world} ranks that shard the model")
        return runs if ns.compare else [("run", runs[0][1])]
    except ValueError as e:
        raise UsageError(str(e)) from None


def _say(line: str) -> None:
    print(f"zeropp train: {line}", file=sys.stderr, flush=True)


def verified_resume(a: TrainArgs, path: str, keep: bool = False,
                    cfg: Optional[zeropp.Config] = None, finished_ok: bool = False) -> str:
    """The checkpoint `--resume path` continues from (see resume.resume_point),
    checked to be this run's (and, given `cfg`, of its ZeRO++ settings) and, unless
    `finished_ok` (the same command again on its --out), to leave steps to train;
    raises UsageError."""
    try:
        ck = resume_point(path, _say, keep)
        man = read_manifest(ck)
        saved = man.get("extra", {}).get("train_args")
        if saved is None:
            raise CheckpointError(f"--resume {ck}: not written by `zeropp train` (no "
                                  "train_args); resume it from your own loop")
        check_same_run(saved, dataclasses.asdict(a), ck)
        if cfg is not None:
            check_same_config(man, cfg, ck)
        if not finished_ok and man["extra"]["step"] >= a.steps:
            # (into another --out the run had no rows: an IndexError once workers ran)
            raise CheckpointError(f"--resume {ck} is at step {man['extra']['step']}: "
                                  f"--steps {a.steps} leaves nothing to train")
        return str(ck)
    except CheckpointError as e:
        raise UsageError(str(e)) from None


def resume_own_run(a: TrainArgs, run_dir: Path, cfg: zeropp.Config, keep: bool = False) -> str:
    """The same command again on an --out that holds checkpoints (after a crash, a kill,
    a reboot): set `a.resume` to continue the run rather than start over its metrics and
    checkpoints; returns the line that says so. Raises UsageError."""
    try:
        a.resume = verified_resume(a, str(run_dir), keep, cfg, finished_ok=True)
    except UsageError as e:
        raise UsageError(f"--out {run_dir} already holds a run that cannot be resumed with "
                         f"these options ({e}); choose another --out") from None
    return (f"{run_dir} already holds this run: resuming it from {Path(a.resume).name} "
            "(another --out starts a new one)")


def train_args_from(ns: argparse.Namespace) -> TrainArgs:
    a = TrainArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(TrainArgs)})
    if a.model not in PRESETS:
        raise UsageError(f"unknown model preset {a.model!r}; choose one of {', '.join(PRESETS)}")
    for k in ("steps", "batch", "seq_len", "accum", "eval_every", "eval_batches", "log_every",
              "keep_checkpoints"):
        if getattr(a, k) < 1:
            raise UsageError(f"--{k.replace('_', '-')} must be at least 1, got {getattr(a, k)}")
    if a.save_every < 0:
        raise UsageError(f"--save-every must be 0 or more, got {a.save_every}")
    for k, ok, rule in [("lr", a.lr > 0, "more than 0"), ("warmup", a.warmup >= 0, "0 or more"),
                        ("min_lr_ratio", 0 <= a.min_lr_ratio <= 1, "in [0, 1]"),
                        ("weight_decay", a.weight_decay >= 0, "0 or more"),
                        ("clip", a.clip > 0, "more than 0 (inf: no clipping)")]:
        if not ok:  # (NaN fails every rule)
            raise UsageError(f"--{k.replace('_', '-')} must be {rule}, got {getattr(a, k)}")
    if a.resume:  # (torchrun: every rank checks; only `zeropp train` sets damaged ones aside)
        a.resume = verified_resume(a, a.resume, keep=True)
    if a.hf_model:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise UsageError("--hf-model needs transformers: pip install 'zeropp[hf]'") from None
    return a


def _config_json(a: TrainArgs, cfg: zeropp.Config, ns: argparse.Namespace) -> str:
    c = cfg.to_dict()
    launch = {"nproc": ns.nproc, "node_size": ns.node_size, "torch": torch.__version__}
    return json.dumps({"train": dataclasses.asdict(a), "zeropp": c, "launch": launch}, indent=2)


def run_train(ns: argparse.Namespace) -> int:
    if ns.nproc < 1 or ns.node_size < 1 or ns.nproc % ns.node_size:
        raise UsageError(f"--nproc {ns.nproc} must be a positive multiple of --node-size "
                         f"{ns.node_size}")
    if ns.max_restarts < 0:
        raise UsageError(f"--max-restarts must be 0 or more, got {ns.max_restarts}")
    if ns.resume and ns.compare:
        raise UsageError("--resume continues one run; it cannot be combined with --compare")
    refuse_unused(ns)
    if ns.replicas != 1:
        return run_replica_train(ns, train_args_from, configs_from, CACHE)
    resume, ns.resume = ns.resume, None  # chosen below, once the run directory is ours
    a = train_args_from(ns)
    runs = configs_from(ns)
    if resume:
        try:
            default_out = run_dir_of(find_checkpoint(resume))
        except CheckpointError as e:
            raise UsageError(str(e)) from None
    else:
        default_out = Path(f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir = Path(ns.out or default_out)
    try:
        ids, vocab = prepare_tokens(a, CACHE)
    except (DataError, TokenizerError) as e:
        raise UsageError(str(e)) from None
    make_dir(run_dir, "--out")
    try:
        with RunLock(run_dir):
            if resume:
                if run_dir.resolve() != default_out.resolve() and candidates(run_dir):
                    # (a restart before this run's first save would take run_dir's `latest`)
                    raise UsageError(f"--out {run_dir} holds checkpoints of another run; "
                                     f"--resume {resume} continues into an empty --out, or "
                                     "into its own run directory")
                a.resume = verified_resume(a, resume, cfg=runs[0][1])
            elif ns.compare and any(candidates(run_dir / n) for n, _ in runs):
                raise UsageError(f"--out {run_dir} already holds runs of a comparison, which "
                                 "is not resumed; choose another --out")
            elif candidates(run_dir):
                _say(resume_own_run(a, run_dir, runs[0][1]))
            try:
                return _train(ns, a, runs, run_dir, ids, vocab)
            finally:  # (also on Ctrl-C: the corpus as int32, 20 MB for Shakespeare)
                (run_dir / "tokens.pt").unlink(missing_ok=True)
    except RunLocked as e:
        raise UsageError(str(e)) from None


def _train(ns: argparse.Namespace, a: TrainArgs, runs: list, run_dir: Path,
           ids: torch.Tensor, vocab: int) -> int:
    tokens_file = run_dir / "tokens.pt"
    torch.save(ids.to(torch.int32), tokens_file)
    print(f"zeropp train: {len(ids):,} tokens (vocab {vocab}), {ns.nproc} ranks as "
          f"{ns.nproc // ns.node_size} nodes x {ns.node_size}, model {a.hf_model or a.model}, "
          f"{a.steps} steps; run directory {run_dir}", flush=True)
    rows, curves = [], {}
    log = run_dir / "failures.log"
    for name, cfg in runs:
        sub = run_dir / name if ns.compare else run_dir
        sub.mkdir(parents=True, exist_ok=True)
        (sub / "config.json").write_text(_config_json(a, cfg, ns))
        if ns.compare:
            print(f"--- {name}: qwZ={cfg.quantized_weights} hpZ={cfg.hpz_partition_size} "
                  f"qgZ={cfg.quantized_gradients}", flush=True)
        try:
            out = spawn(train_worker, ns.nproc, ns.node_size,
                        args=(a, cfg, str(sub), str(tokens_file), vocab), timeout=None,
                        pg_timeout=1800, max_restarts=ns.max_restarts, verbose=ns.verbose,
                        log=str(log))[0]
        except WorkerError as e:
            if e.fatal:  # the workers' bad input (a checkpoint that does not load)
                raise UsageError(e.short.split(": ", 1)[-1]) from None
            after = f" after {ns.max_restarts} restart(s)" if ns.max_restarts else ""
            print(f"zeropp train failed{after}: {e.short}; tracebacks in {log}",
                  file=sys.stderr, flush=True)
            return 1
        rows.append(summarize(name, out))
        curves[name] = out["history"]
        (sub / "summary.json").write_text(json.dumps(rows[-1], indent=2))
        if not ns.compare:
            plot(curves, sub / "loss.png", f"zeropp: {a.hf_model or a.model}, {ns.nproc} ranks")
    if ns.compare:
        drew = plot(curves, run_dir / "compare.png", f"zeropp: {', '.join(curves)}")
        (run_dir / "summary.md").write_text(table(rows) + "\n")
    else:
        drew = (run_dir / "loss.png").exists()
    print("\n" + table(rows))
    if out["nodes"] > 1:
        print(f"\nZeRO-3's analytic inter-node bytes: "
              f"{out['zero3_inter_node_bytes'] / 1e6:.2f} MB per node per step.")
    files = "config.json, metrics.jsonl, summary.json, checkpoints/"
    shown = (f", loss plot {'compare.png' if ns.compare else 'loss.png'}" if drew
             else " (no plot: matplotlib is not installed)")
    each = ", ".join(name + "/" for name, _ in runs)
    print(f"Files in {run_dir}/: " + (f"summary.md{shown}; in each of {each}: {files}"
                                      if ns.compare else files + shown))
    return 0


class Terminated(BaseException):
    """SIGTERM, raised where the main thread is, so that every `finally` on the way out
    runs (the workers stopped, the run's lock and RUN/tokens.pt gone), as for Ctrl-C."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="zeropp", description="ZeRO-3 + ZeRO++ in plain PyTorch")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a GPT on Shakespeare (or your text) with zeropp")
    add_train_args(t)
    pl = sub.add_parser("plan", help="predict each configuration's step time on a cluster")
    pl.add_argument("--params", type=float, required=True, help="e.g. 7e9")
    pl.add_argument("--nodes", type=int, required=True)
    pl.add_argument("--gpus-per-node", type=int, required=True)
    pl.add_argument("--inter-gbps", type=float, required=True, help="per node link")
    pl.add_argument("--intra-gbps", type=float, default=2400.0, help="per GPU in a node")
    pl.add_argument("--tokens-per-gpu", type=int, default=2048)
    pl.add_argument("--tflops", type=float, default=300.0, help="achieved per GPU")
    pl.add_argument("--param-bytes", type=int, default=2, help="compute dtype width")
    pl.add_argument("--reduce-bytes", type=int, default=2, help="ZeRO-3 gradient width")
    pl.add_argument("--units", type=int, default=32, help="transformer blocks")
    pl.add_argument("--alpha-us", type=float, default=10.0, help="latency per message hop")
    pl.add_argument("--overlap", type=float, default=0.0,
                    help="fraction of the shorter of compute/communication hidden (0..1), "
                         "forward and backward each on their own")
    pl.add_argument("--compute-s", type=float, default=0.0,
                    help="measured compute seconds per step (overrides --tflops)")
    pl.add_argument("--recompute", action="store_true",
                    help="activation checkpointing: 8 instead of 6 FLOPs per param per token")
    pl.add_argument("--json", action="store_true",
                    help="print the prediction as JSON (cluster, per-config rows, advice)")
    b = sub.add_parser("bench", help="configurations side by side on an emulated cluster")
    b.add_argument("--nodes", type=int, default=2)
    b.add_argument("--node-size", type=int, default=2)
    b.add_argument("--nproc", type=int, default=None, help="total ranks (checks the layout)")
    b.add_argument("--inter-node", default="100mbit", help="link rate, e.g. 100mbit, 1gbit")
    b.add_argument("--configs", default="fsdp2,fsdp2-hsdp,zero3,qwz,hpz,qgz,zeropp,zeropp-plus")
    b.add_argument("--model", default="gpt-6x384", help=f"preset: {', '.join(PRESETS)}")
    b.add_argument("--seq-len", type=int, default=64)
    b.add_argument("--batch", type=int, default=2)
    b.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    b.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                   help="compute dtype for every configuration (bf16 is ~150x slower here)")
    b.add_argument("--compute-baseline", action="store_true",
                   help="also run every configuration on unshaped links (its compute time), "
                        "each right after its shaped run, and report step / max(compute, link)")
    b.add_argument("--rounds", type=int, default=1,
                   help="run the configurations this many times in turn (A B A B ...); the "
                        "table gives the median over every round, and a line how often "
                        "the fastest won round by round (drift between runs cancels)")
    b.add_argument("--timeout", type=float, default=1800)
    b.add_argument("--out", default=None)
    b.add_argument("--write", default=None, metavar="RESULTS_MD",
                   help="append the table to this markdown file (e.g. benchmarks/RESULTS.md)")
    e = sub.add_parser("export", help="one consolidated model.safetensors from a checkpoint")
    e.add_argument("checkpoint", help="a checkpoint directory (zeropp.save_checkpoint)")
    e.add_argument("out", help="output directory: model.safetensors (+ config.json for a "
                               "transformers model, so from_pretrained(OUT) works)")
    e.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help="cast floating tensors (default: as saved, fp32 masters)")
    la = sub.add_parser("launch", help="run a training script on N local ranks, like torchrun "
                                       "(nodes of --node-size emulated)")
    la.add_argument("--nproc", type=int, default=4, help="ranks")
    la.add_argument("--node-size", type=int, default=None,
                    help="ranks per emulated node (default: all on one node)")
    la.add_argument("--max-restarts", type=int, default=0,
                    help="restart the whole world this many times after a failure")
    la.add_argument("--timeout", type=float, default=None, help="seconds (default: none)")
    la.add_argument("--verbose", action="store_true",
                    help="restart lines carry the failing rank's last message line (gloo's)")
    la.add_argument("--preload", default="", metavar="MODULES",
                    help="comma-separated modules the script imports (e.g. transformers,trl), "
                         "imported once before the ranks fork instead of once per rank")
    la.add_argument("--as-deepspeed", action="store_true",
                    help="`import deepspeed` answers with zeropp in every rank (and in the "
                         "preloads: --preload transformers,accelerate,trl works), as if the "
                         "script began with zeropp.install_as_deepspeed()")
    la.add_argument("script")
    la.add_argument("args", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    if ns.cmd == "launch" and ns.node_size is None:
        ns.node_size = ns.nproc
    if argv is None:  # (also replaces quiet_start's handlers, which skip every cleanup)
        # Ctrl-C must stop the run and its workers even when the process that
        # started us left SIGINT blocked or ignored (both are inherited across exec).
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _terminated)  # `kill`, a scheduler's stop: as Ctrl-C
    try:
        if ns.cmd == "export":
            return run_export(ns)
        if ns.cmd == "plan":
            return run_plan(ns)
        if ns.cmd == "bench":
            return run_bench_cmd(ns, argv)
        if ns.cmd == "launch":
            return run_launch(ns)
        return run_train(ns)
    except UsageError as e:
        print(f"zeropp {ns.cmd}: {e}", file=sys.stderr)
        return 2
    except WorkerError as e:
        print(f"zeropp {ns.cmd} failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"zeropp {ns.cmd}: interrupted; all workers stopped", file=sys.stderr)
        return 130
    except Terminated:
        print(f"zeropp {ns.cmd}: terminated (SIGTERM); all workers stopped", file=sys.stderr)
        return 128 + signal.SIGTERM


if __name__ == "__main__":
    sys.exit(main())
