"""The training run's checkpoints: RUN/checkpoints/step_NNNNNN, a `latest`
pointer replaced atomically after each save, the oldest pruned beyond `keep`.

A resumed run restores the model, optimizer, step (hence the LR schedule),
each rank's data-sampling generator and RNG states, so it continues exactly
as if it had never stopped (tests/test_resume.py checks the losses bit for bit).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from ..checkpoint_files import MANIFEST, CheckpointError, resolve

# What must match for a resumed run to be the same run (the step count, the
# evaluation and logging cadence may change).
SAME_RUN = ("model", "hf_model", "tokenizer", "seq_len", "batch", "accum", "seed", "data")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def latest(run_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint of a run directory, or None."""
    ptr = checkpoint_dir(run_dir) / "latest"
    if ptr.is_file():
        ck = checkpoint_dir(run_dir) / ptr.read_text().strip()
        if (ck / MANIFEST).is_file():
            return ck
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


def after_save(run_dir: Path, name: str, keep: int) -> None:
    """Rank 0: point `latest` at the new checkpoint, then prune the oldest."""
    if dist.get_rank() != 0:
        return
    d = checkpoint_dir(run_dir)
    tmp = d / ".latest.tmp"
    tmp.write_text(name + "\n")
    os.replace(tmp, d / "latest")
    done = sorted(p for p in d.glob("step_*") if (p / MANIFEST).is_file())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
