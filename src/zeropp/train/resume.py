"""The training run's checkpoints: RUN/checkpoints/step_NNNNNN, a `latest`
pointer replaced atomically after each save, the oldest pruned beyond `keep`.

A resumed run restores the model, optimizer, step (hence the LR schedule),
each rank's data-sampling generator and RNG states, so it continues exactly
as if it had never stopped (tests/test_resume.py checks the losses bit for bit).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from ..checkpoint_files import MANIFEST, CheckpointError, resolve
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


def after_save(run_dir: Path, name: str, keep: int) -> None:
    """Collective. Rank 0 points `latest` at the new checkpoint and prunes
    checkpoints of earlier steps beyond `keep` (later ones, left by a run
    resumed from further back, are never deleted). A failure is raised on
    every rank."""
    err = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            d = checkpoint_dir(run_dir)
            tmp = d / ".latest.tmp"
            tmp.write_text(name + "\n")
            os.replace(tmp, d / "latest")
            step = int(name[5:])
            older = [p for p in _complete(run_dir) if int(p.name[5:]) < step]
            for old in older[:max(0, len(older) - (keep - 1))]:
                shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            err = f"after saving {name}: {e}"
    agree(err, CheckpointError)
