"""The training run's checkpoints: RUN/checkpoints/step_NNNNNN, a `latest`
pointer replaced atomically after each save, the oldest pruned beyond `keep`.

A resumed run restores the model, optimizer, step (hence the LR schedule),
each rank's data-sampling generator and RNG states, so it continues exactly
as if it had never stopped (tests/apps/test_resume.py checks the losses bit for bit).

[Note: which checkpoint a run resumes from]
The newest that verifies: the one `latest` names, then complete ones of
earlier steps, newest first (later steps belong to a timeline abandoned by a
resume from further back). A run resumed from one of its own checkpoints names
that one `latest` before its first step (`resumed_at`): a worker restarted after
a crash before the run's first save then continues from it, not from the later
checkpoint of the abandoned timeline (whose steps this run has not run, maybe on
another LR schedule). Verifying is what a load checks anyway: every
rank file's size and sha256 against the manifest. A damaged checkpoint is
named in one line and renamed to `step_N.damaged`, never deleted: the run's
next save of step N would otherwise replace it without a trace.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..checkpoint import config_changes
from ..checkpoint_files import (
    MANIFEST,
    CheckpointError,
    RankFile,
    read_manifest,
    resolve,
    verify,
)
from ..config import Config
from ..guards import agree

# What must match for a resumed run to be the same run (the step count, the
# evaluation and logging cadence may change).
SAME_RUN = ("model", "hf_model", "tokenizer", "seq_len", "batch", "accum", "seed", "data")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


_STEP = re.compile(r"step_(\d+)")


def _complete(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first (by step)."""
    d = checkpoint_dir(run_dir)
    found = [p for p in d.glob("step_*") if _STEP.fullmatch(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest(run_dir: Path) -> Optional[Path]:
    """The checkpoint `latest` names (a plain step_N inside the run, possibly
    left at .step_N.old by a save that died between its renames), else the
    newest complete one; None if there is none."""
    ptr = checkpoint_dir(run_dir) / "latest"
    name = ptr.read_text().strip() if ptr.is_file() else ""
    if _STEP.fullmatch(name):
        try:
            return resolve(checkpoint_dir(run_dir) / name)
        except CheckpointError:
            pass
    done = _complete(run_dir)
    return done[-1] if done else None


def candidates(run_dir: Path) -> list[Path]:
    """The checkpoints a run may resume from, in the order to try them: the one
    `latest` names (or `.step_N.old` where a save died between its renames),
    then complete ones of earlier steps, newest first."""
    ptr = checkpoint_dir(run_dir) / "latest"
    name = ptr.read_text().strip() if ptr.is_file() else ""
    first: list[Path] = []
    bound = None
    if _STEP.fullmatch(name):
        bound = int(name[5:])
        try:
            ck = resolve(checkpoint_dir(run_dir) / name)
            first = [ck] if (ck / MANIFEST).is_file() else []
        except CheckpointError:
            pass
    rest = [p for p in reversed(_complete(run_dir))
            if (bound is None or int(p.name[5:]) < bound) and p not in first]
    return first + rest


def verify_checkpoint(ck: Path) -> None:
    """Raise CheckpointError naming the first rank file whose size or sha256
    differs from the manifest (or a manifest that is not one)."""
    man = read_manifest(ck)
    for name, info in sorted(man["files"].items()):
        verify(ck / name, info)


def set_aside(ck: Path) -> Path:
    """Rename a damaged checkpoint out of the run's way; returns the new path."""
    stem = ck.name.lstrip(".").removesuffix(".old")
    dest, n = ck.with_name(f"{stem}.damaged"), 1
    while dest.exists():
        n += 1
        dest = ck.with_name(f"{stem}.damaged{n}")
    os.rename(ck, dest)
    return dest


def choose(run_dir: Path, say: Callable[[str], None], keep: bool = False) -> Optional[Path]:
    """The newest checkpoint of `run_dir` that verifies (None: the run has none);
    each damaged newer one is named through `say` and set aside (left in place
    with `keep`). Raises CheckpointError if there are checkpoints and none
    verifies."""
    tried = candidates(run_dir)
    for ck in tried:
        try:
            verify_checkpoint(ck)
            return ck
        except CheckpointError as e:
            moved = "" if keep else f"; kept as {set_aside(ck).name}"
            say(f"skipping damaged checkpoint {ck.name} ({e}){moved}")
    if tried:
        raise CheckpointError(f"{run_dir}: none of its {len(tried)} checkpoint(s) verifies")
    return None


def find(path: str) -> Path:
    """`--resume PATH`: a checkpoint directory, or a run directory (its latest)."""
    p = Path(path)
    if (p / MANIFEST).is_file() or (p.parent / f".{p.name}.old" / MANIFEST).is_file():
        return resolve(p)
    for run in (p, p.parent):
        ck = latest(run)
        if ck is not None:
            return ck
    raise CheckpointError(f"--resume {path}: neither a checkpoint (no {MANIFEST}) nor a run "
                          "directory with checkpoints/latest")


def run_dir_of(ckpt: Path) -> Path:
    """The run directory a checkpoint belongs to (RUN/checkpoints/step_N -> RUN)."""
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent


def check_same_run(saved: dict, now: dict, ckpt: Path) -> None:
    diff = [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in SAME_RUN
            if saved.get(k) != now.get(k)]
    if diff:
        raise CheckpointError(f"--resume {ckpt}: the run's settings differ from the "
                              f"checkpoint's ({'; '.join(diff)})")


# Config fields a preset sizes from the node (hpZ's group is the node; qWD needs hpZ): at
# another node size they follow it, and the run reshards (not exact) anyway.
FOLLOW_NODE = ("hpz_partition_size", "weight_delta")


def check_same_config(man: dict, cfg: Config, ckpt: Path) -> None:
    """The ZeRO++ settings of the checkpoint's run must give the numbers `cfg` gives: another
    preset or switch would continue a run it did not start (SCHEDULE_ONLY fields may change)."""
    diff = config_changes(man.get("config"), cfg)
    if man.get("node_size") != cfg.node_size:
        diff = {k: v for k, v in diff.items() if k not in FOLLOW_NODE}
    if diff:
        text = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
        raise CheckpointError(f"--resume {ckpt}: the ZeRO++ settings differ from the "
                              f"checkpoint's ({text})")


def after_save(run_dir: Path, name: str, keep: int) -> None:
    """Collective. Rank 0 points `latest` at the new checkpoint and prunes
    checkpoints of earlier steps beyond `keep` (later ones, left by a run
    resumed from further back, are never deleted). A failure is raised on
    every rank."""
    err = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            _point_latest(run_dir, name)
            step = int(name[5:])
            older = [p for p in _complete(run_dir) if int(p.name[5:]) < step]
            for old in older[:max(0, len(older) - (keep - 1))]:
                shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            err = f"after saving {name}: {e}"
    agree(err, CheckpointError, "checkpoint")


def resumed_at(run_dir: Path, ck: Path) -> None:
    """Collective. A run that loaded `ck`, one of its own checkpoints, has rank 0
    name it `latest` (see the note at the top); `ck` of another run leaves `latest`
    as it is. Pruning stays after_save's: it moves `latest` first, and never deletes
    later steps. A failure is raised on every rank."""
    err = None
    own = ck.parent.resolve() == checkpoint_dir(run_dir).resolve()
    if own and (not dist.is_initialized() or dist.get_rank() == 0):
        try:
            _point_latest(run_dir, ck.name.lstrip(".").removesuffix(".old"))
        except OSError as e:
            err = f"naming {ck.name} the latest checkpoint: {e}"
    agree(err, CheckpointError, "checkpoint")


def _point_latest(run_dir: Path, name: str) -> None:
    """Replace `latest` atomically: a crash leaves the old pointer or the new one."""
    d = checkpoint_dir(run_dir)
    tmp = d / ".latest.tmp"
    tmp.write_text(name + "\n")
    os.replace(tmp, d / "latest")


def resume_point(path: str, say: Callable[[str], None], keep: bool = False) -> Path:
    """`--resume PATH`, verified: a checkpoint directory must verify itself (the
    user named it); a run directory gives its newest checkpoint that verifies,
    damaged newer ones named through `say` (see `choose`)."""
    p = Path(path)
    if (p / MANIFEST).is_file() or (p.parent / f".{p.name}.old" / MANIFEST).is_file():
        ck = resolve(p)
        verify_checkpoint(ck)
        return ck
    for run in (p, p.parent):
        if candidates(run):
            ck = choose(run, say, keep)
            assert ck is not None
            return ck
    return find(path)  # raises the error that names what PATH is not


# ---- comparison ---------------------------------------------------------------------
# Global RNG states that fork servers and forked workers seed from the OS, which a
# training loop that draws only from torch generators never uses, and the path a
# run was resumed from: equal runs may differ in them.
INCIDENTAL = ("python_rng", "numpy_rng")


def differences(a: os.PathLike, b: os.PathLike) -> list[str]:
    """What differs between two checkpoints of the same world size, rank file by
    rank file (each verified first): every tensor byte for byte (master shards,
    optimizer state, torch RNG states, per-rank extras such as a data sampler)
    and the JSON metadata beside them, less INCIDENTAL and a `resume` entry of
    the `train_args` extra. [] means the two are bit for bit the same run."""
    a, b = resolve(a), resolve(b)
    ma, mb = read_manifest(a), read_manifest(b)
    if sorted(ma["files"]) != sorted(mb["files"]):
        return ["rank files"]
    out = []
    for name in sorted(ma["files"]):
        verify(a / name, ma["files"][name])
        verify(b / name, mb["files"][name])
        x, y = RankFile(a / name), RankFile(b / name)
        if sorted(x.keys()) != sorted(y.keys()):
            out.append(f"{name}: tensor names")
        for k in sorted(set(x.keys()) & set(y.keys())):
            s, t = x.get_tensor(k), y.get_tensor(k)
            if s.dtype != t.dtype or s.shape != t.shape or not torch.equal(
                    s.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)):
                out.append(f"{name}: {k}")
        meta = []
        for f in (x, y):
            m = json.loads(f.metadata().get("zeropp", "{}"))
            for key in INCIDENTAL:
                m.pop(key, None)
            m.get("extra", {}).get("train_args", {}).pop("resume", None)
            meta.append(m)
        if meta[0] != meta[1]:
            out.append(f"{name}: metadata")
    return out
