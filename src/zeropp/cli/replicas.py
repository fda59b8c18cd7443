"""`zeropp train --replicas R`: its options and its run (train/replicas.py does the work)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from ..train.data import DataError
from ..train.loop import TrainArgs, prepare_tokens
from ..train.model import PRESETS
from ..train.tokenizer import TokenizerError
from .commands import UsageError, make_dir


def add_replica_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replica groups across slow links (torchft; zeropp[ft])")
    g.add_argument("--replicas", type=int, default=1,
                   help="R > 1: R replica groups of nproc/R ranks (one node each), zeropp "
                        "inside each, torchft's Manager and lighthouse across them")
    g.add_argument("--sync-every", type=int, default=1,
                   help="with --replicas: 1 = fault-tolerant HSDP (every step's gradients), "
                        "H > 1 = DiLoCo, an outer Nesterov step every H inner steps")
    g.add_argument("--outer-codec", default="2bit", choices=["fp32", "int8", "int4", "2bit"],
                   help="with --replicas: what crosses between the groups (zeropp.ft.wrap)")
    g.add_argument("--inside", default="engine", choices=["engine", "fsdp2", "stock-fsdp2"],
                   help="with --replicas: what shards each group: zeropp's engine, FSDP2 with "
                        "zeropp.fsdp2.install, or stock FSDP2 (FSDP2: the groups' mean by "
                        "torchtitan's all-reduce hook; --sync-every 1, no --kill-replica-at)")
    g.add_argument("--outer-lr", type=float, default=0.7,
                   help="with --sync-every H > 1: the outer Nesterov SGD's learning rate")
    g.add_argument("--outer-momentum", type=float, default=0.9,
                   help="with --sync-every H > 1: its momentum (0: plain averaging at lr 1)")
    g.add_argument("--fragments", type=int, default=1,
                   help="with --sync-every H: Streaming DiLoCo, the model in F fragments, one "
                        "synced every H/F steps (F divides H)")
    g.add_argument("--kill-replica-at", type=int, default=None, metavar="STEP",
                   help="with --replicas: SIGKILL the last group at STEP, restart it "
                        "--restart-after steps later; it heals from a live group")
    g.add_argument("--restart-after", type=int, default=30)
    g.add_argument("--link", default=None, metavar="RATE",
                   help="with --replicas: each group on an emulated node (a network namespace; "
                        "root), the links between them at RATE, e.g. 10mbit")
    g.add_argument("--link-delay", default="0ms", metavar="DELAY",
                   help="with --link: each packet's one-way delay between nodes, e.g. 50ms "
                        "(a 100 ms round trip)")


# What each option of the group does nothing without (given anyway: refused by name, so a
# run believed to be DiLoCo, or on a shaped link, is not silently something else).
_NEEDS = {"sync_every": "--replicas", "outer_codec": "--replicas", "inside": "--replicas",
          "kill_replica_at": "--replicas", "link": "--replicas", "outer_lr": "--sync-every H > 1",
          "outer_momentum": "--sync-every H > 1", "fragments": "--sync-every H > 1",
          "restart_after": "--kill-replica-at", "link_delay": "--link"}


def refuse_unused(ns: argparse.Namespace) -> None:
    met = {"--replicas": ns.replicas != 1, "--sync-every H > 1": ns.sync_every != 1,
           "--kill-replica-at": ns.kill_replica_at is not None, "--link": ns.link is not None}
    met["--sync-every H > 1"] &= met["--replicas"]
    probe = argparse.ArgumentParser()
    add_replica_args(probe)
    for a in probe._actions:
        need = _NEEDS.get(a.dest)
        if need and getattr(ns, a.dest) != a.default and not met[need]:
            raise UsageError(f"{a.option_strings[0]} {getattr(ns, a.dest)} does nothing "
                             f"without {need}")


def run_replica_train(ns: argparse.Namespace, train_args_from, configs_from,
                      cache: Path) -> int:
    """`--replicas R`: R replica groups under torchft (train/replicas.py). The three
    after `ns` are main.py's: the run's TrainArgs and Config from the options, and the
    token cache."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise UsageError("--replicas needs torchft: pip install 'zeropp[ft]'") from None
    from ..train.replicas import ReplicaArgs, run_replicas
    R, H = ns.replicas, ns.sync_every
    if R < 2 or ns.nproc % R:
        raise UsageError(f"--replicas {R} must be at least 2 and divide --nproc {ns.nproc}")
    if H < 1:
        raise UsageError(f"--sync-every must be at least 1, got {H}")
    if ns.inside != "engine" and (H != 1 or ns.kill_replica_at is not None):
        raise UsageError(f"--inside {ns.inside} runs HSDP (--sync-every 1) without "
                         "--kill-replica-at: DiLoCo over DTensors and healing FSDP2's "
                         "optimizer state are not written")
    if ns.fragments < 1 or H % ns.fragments:
        raise UsageError(f"--fragments {ns.fragments} must be at least 1 and divide "
                         f"--sync-every {H}")
    if ns.compare or ns.resume or ns.max_restarts:
        raise UsageError("--replicas keeps the run going through failures itself; it does not "
                         "take --compare, --resume or --max-restarts")
    a = train_args_from(ns)
    d = TrainArgs()
    for k in ("accum", "save_every", "keep_checkpoints"):  # (it trained on without them)
        if getattr(a, k) != getattr(d, k):
            raise UsageError(f"--replicas runs one micro-batch a step and writes no "
                             f"checkpoints: it does not take --{k.replace('_', '-')} "
                             f"{getattr(a, k)}")
    units = PRESETS[a.model]["n_layer"] + 1 if a.model in PRESETS else None
    if ns.fragments > 1 and (a.hf_model or units is None or ns.fragments > units):
        raise UsageError(f"--fragments {ns.fragments}: the fragments are zeropp's units, a "
                         f"block each plus the embeddings and head ({units or '?'} for "
                         f"--model {a.model}); give at most that many, and no --hf-model")
    if H > 1 and a.steps % H:  # end on a sync, where every group holds the same weights
        rounded = -(-a.steps // H) * H
        print(f"zeropp train: --steps {a.steps} is not a multiple of --sync-every {H}; "
              f"running {rounded} ({rounded // H} rounds) so that the run ends on a sync",
              flush=True)
        a.steps = rounded
    cluster = None
    if ns.link is not None:
        from ..bench.cluster import Cluster, available
        try:
            cluster = Cluster(R, ns.link, prefix="zppr", delay=ns.link_delay)
        except ValueError as e:
            raise UsageError(str(e)) from None
        ok, why = available()
        if not ok:
            raise UsageError(f"--link needs the emulated cluster: {why}")
    k = ns.kill_replica_at
    if k is not None and not (0 < k < a.steps - 1):
        raise UsageError(f"--kill-replica-at {k} must be between 1 and --steps - 2")
    ra = ReplicaArgs(replicas=R, group_size=ns.nproc // R, sync_every=H,
                     outer_codec=ns.outer_codec, kill_at=k, restart_after=ns.restart_after,
                     fragments=ns.fragments, driver=ns.inside, outer_lr=ns.outer_lr,
                     outer_momentum=ns.outer_momentum)
    ns.node_size = ra.group_size  # a group is one node: everything between them crosses
    (_, cfg), = configs_from(ns)
    try:
        ids, vocab = prepare_tokens(a, cache)
    except (DataError, TokenizerError) as e:
        raise UsageError(str(e)) from None
    run_dir = Path(ns.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    if any(run_dir.glob("replica*/metrics.jsonl")):
        raise UsageError(f"--out {run_dir} already holds a replica run; choose another --out")
    make_dir(run_dir, "--out")
    tokens = run_dir / "tokens.pt"
    torch.save(ids.to(torch.int32), tokens)
    (run_dir / "config.json").write_text(json.dumps(
        {"train": dataclasses.asdict(a), "zeropp": cfg.to_dict(),
         "replicas": dataclasses.asdict(ra)}, indent=2))
    mode = "HSDP (every step)" if H == 1 else f"DiLoCo every {H} steps" + (
        f" in {ns.fragments} fragments (Streaming)" if ns.fragments > 1 else "")
    print(f"zeropp train: {R} replica groups x {ra.group_size} ranks, {mode}, outer codec "
          f"{ns.outer_codec}, model {a.model}, {a.steps} steps; run directory {run_dir}",
          flush=True)
    try:
        if cluster is None:
            groups = run_replicas(a, cfg, ra, run_dir, tokens, vocab)
        else:
            with cluster:
                groups = run_replicas(a, cfg, ra, run_dir, tokens, vocab, cluster=cluster)
    except RuntimeError as e:
        print(f"zeropp train failed: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        tokens.unlink(missing_ok=True)
    from ..train.report import plot_replicas
    drew = plot_replicas(groups, run_dir / "loss.png",
                         f"zeropp + torchft: {R} replicas, {mode}, {ns.outer_codec}")
    lines = ["| replica | steps logged | committed syncs | min participants | final val loss "
             "| cross-node MB/step |", "|---|---|---|---|---|---|"]
    for g, rows in groups.items():
        syncs = [r for r in rows if r["committed"] is not None]
        vals = [r["val_loss"] for r in rows if "val_loss" in r]
        mb = sum(r["cross_node_bytes"] for r in rows) / max(1, len(rows)) / 1e6
        lines.append(f"| {g} | {len(rows)} | {sum(r['committed'] for r in syncs)}/{len(syncs)} "
                     f"| {min((r['participants'] for r in syncs), default=0)} | "
                     f"{vals[-1] if vals else float('nan'):.4f} | {mb:.3f} |")
    (run_dir / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
    print(f"Files in {run_dir}/: config.json, replica<g>/metrics.jsonl, summary.md"
          + (", loss.png" if drew else " (no plot: matplotlib is not installed)"))
    return 0
