"""The subcommands beside `zeropp train` (main.py): `zeropp bench` (measured steps on
an emulated cluster), `zeropp plan` (the cost model), `zeropp export` (a checkpoint
to one file) and `zeropp launch` (a script on N ranks)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from ..checkpoint_files import CheckpointError
from ..train.model import PRESETS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class UsageError(ValueError):
    """Bad input: reported in one line, exit status 2."""


def make_dir(path: os.PathLike, flag: str) -> Path:
    """`mkdir -p path`; a file in the way or no permission is a UsageError naming
    `flag` (it was a traceback)."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot create this directory ({e.strerror})"
                         ) from None
    return Path(path)


def _version(pkg: str) -> str:
    from importlib.metadata import version
    try:
        return version(pkg)
    except Exception:
        return "?"


def run_bench_cmd(ns: argparse.Namespace, argv: Optional[list[str]]) -> int:
    from ..bench.plan import winner
    from ..bench.run import chart, rounds_line, run_bench, table
    if ns.model not in PRESETS:
        raise UsageError(f"unknown model preset {ns.model!r}; choose one of {', '.join(PRESETS)}")
    try:
        results, bench_dir = run_bench(ns)
    except ValueError as e:
        raise UsageError(str(e)) from None
    except RuntimeError as e:
        print(f"zeropp bench failed: {e}", file=sys.stderr)
        return 1
    text = table(results)
    if len(results) > 1:
        text += "\n\n" + winner({r["config"]: r["median_step_s"] for r in results},
                                  f"measured, {results[0]['link']}")
        if ns.rounds > 1:
            text += "\n" + rounds_line(results)
    r0 = results[0]
    head = (f"{r0['params'] / 1e6:.1f}M-parameter GPT ({ns.model}, {ns.dtype}), {ns.nodes} "
            f"nodes x {ns.node_size} ranks, inter-node link {r0['link']}, micro-batch "
            f"{ns.batch} x {ns.seq_len}, median of {ns.steps} steps after a warm-up"
            + (f", in each of {ns.rounds} rounds (configurations in turn)"
               if ns.rounds > 1 else ""))
    if any(r["config"].startswith("deepspeed") for r in results):
        head += (f"; deepspeed-* rows: DeepSpeed {_version('deepspeed')} ZeRO-3 (hpz: "
                 "zero_hpz_partition_size = node size, overlap_comm on, its own prefetch "
                 "buckets); DeepSpeed's qwZ and qgZ need CUDA kernels and do not run on CPU")
    if any("compute_s" in r for r in results):
        head += ("; compute s: the same configuration on unshaped links right after it; "
                 "link s: max(tx, rx) wire bytes of the busiest node / link rate; phase "
                 "bound: max(forward compute, forward link) + max(backward compute, backward "
                 "link) + optimizer step, the shortest step the schedule allows (the link "
                 "time split by the accounted forward share)")
    print("\n" + head + "\n\n" + text)
    png = bench_dir / "bench.png"
    if chart(results, png, f"zeropp bench: {ns.nodes}x{ns.node_size}, {r0['link']}"):
        print(f"\nchart: {png}; results: {bench_dir / 'bench.json'}")
    if ns.write:
        cmd = "zeropp bench " + " ".join(argv if argv is not None else sys.argv[2:])
        with open(ns.write, "a") as f:
            f.write(f"\n### Emulated cluster: {r0['link']} ({time.strftime('%Y-%m-%d')})\n\n"
                    f"Command: `{cmd}`  \n{head}.\n\n{text}\n")
    return 0


def run_plan(ns: argparse.Namespace) -> int:
    from ..bench.plan import Cluster, format_table, plan, recommend
    try:
        c = Cluster(params=ns.params, nodes=ns.nodes, gpus_per_node=ns.gpus_per_node,
                    inter_gbps=ns.inter_gbps, intra_gbps=ns.intra_gbps,
                    tokens_per_gpu=ns.tokens_per_gpu, tflops=ns.tflops,
                    param_bytes=ns.param_bytes, reduce_bytes=ns.reduce_bytes, units=ns.units,
                    alpha_us=ns.alpha_us, overlap=ns.overlap, compute_s=ns.compute_s,
                    recompute=ns.recompute)
    except ValueError as e:
        raise UsageError(str(e)) from None
    rows = plan(c)
    if ns.json:
        print(json.dumps({"cluster": dataclasses.asdict(c), "configs": rows,
                          "recommendation": recommend(rows)}, indent=1))
        return 0
    print(format_table(c, rows))
    print("\n" + recommend(rows))
    return 0


def run_export(ns: argparse.Namespace) -> int:
    from .export import export
    make_dir(ns.out, "OUT")
    try:
        files = export(ns.checkpoint, ns.out, dtype=DTYPES[ns.dtype] if ns.dtype else None)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    print(f"zeropp export: wrote {', '.join(str(f) for f in files)}")
    return 0


def run_launch(ns: argparse.Namespace) -> int:
    from .launch import PreloadError, host_store, run_script, spawn
    if not os.path.isfile(ns.script):
        raise UsageError(f"no such script: {ns.script}")
    if ns.nproc < 1 or ns.node_size < 1 or ns.nproc % ns.node_size:
        raise UsageError(f"--node-size {ns.node_size} must divide --nproc {ns.nproc} (both >= 1)")
    preload = [m for m in ns.preload.split(",") if m]
    if ns.as_deepspeed:
        # Here, and before the checks below (find_spec imports a dotted name's parents,
        # which would make transformers decide first): a refusal (the real DeepSpeed
        # installed) is one line from the launcher, not a fork server that fails to
        # start. The server then imports deepspeed/installed.py before its preloads, so
        # they and every rank forked from it see zeropp as DeepSpeed.
        from ..deepspeed.alias import install_as_deepspeed
        try:
            install_as_deepspeed()
        except RuntimeError as e:
            raise UsageError(f"--as-deepspeed: {e}") from None
        preload.insert(0, "zeropp.deepspeed.installed")
    import importlib.util
    for m in preload:  # multiprocessing skips a preload it cannot import, silently
        try:
            found = importlib.util.find_spec(m) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UsageError(f"--preload: no module named {m!r}")
    # This process hosts each attempt's rendezvous store (a restarted world meets in a
    # fresh one), as torchrun's agent does. The ranks fork from it directly: it has
    # imported torch already, so a fork server importing it again would only add
    # its 1.5-3 s (measured, 4 ranks: an empty script 4.9 -> 3.4 s, TRL SFT
    # 12.0-14.9 -> 9.8-10.8 s). It runs no tensor op first (no thread pool to
    # inherit); the stores' threads are not the workers' (they never touch them).
    stores = [host_store() for _ in range(ns.max_restarts + 1)]
    try:
        spawn(run_script, ns.nproc, ns.node_size,
              args=(ns.script, ns.args, [s.port for s in stores]),
              timeout=ns.timeout, max_restarts=ns.max_restarts, preload=preload, start="fork",
              verbose=ns.verbose)
    except PreloadError as e:  # a --preload that exists but raises when imported
        raise UsageError(f"--preload: {e}") from None
    return 0
