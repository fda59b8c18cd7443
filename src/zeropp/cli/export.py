"""`zeropp export CKPT OUT`: a checkpoint's consolidated weights as one
model.safetensors under the original names (and, for a transformers model, its
config.json, so `from_pretrained(OUT)` works). Reads the checkpoint's files alone:
no process group."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from ..checkpoint_files import (
    CheckpointError,
    consolidate,
    fsync_dir,
    read_manifest,
    resolve,
    write_safetensors,
)


def export(ckpt: os.PathLike, out: os.PathLike, *, dtype: Optional[torch.dtype] = None
           ) -> list[Path]:
    """Write `out/model.safetensors` (original names, loadable by the unsharded
    model's `load_state_dict`) and, for a transformers model, `out/config.json`
    so that `from_pretrained(out)` works. Returns the files written."""
    ckpt = resolve(ckpt)
    sd = consolidate(ckpt)
    hf = read_manifest(ckpt).get("hf")
    if hf:
        prefix = hf["prefix"]
        outside = [n for n in sd if not n.startswith(prefix)]
        if outside:
            raise CheckpointError(
                f"export: {len(outside)} tensor(s) live outside the transformers model at "
                f"{prefix[:-1]!r} (first: {outside[0]!r}); from_pretrained could not load them")
        sd = {n[len(prefix):]: t for n, t in sd.items()}
    if dtype is not None:
        sd = {n: (t.to(dtype) if t.is_floating_point() else t) for n, t in sd.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "model.safetensors"]
    tmp = out / ".model.safetensors.partial"
    write_safetensors(tmp, sd, {"format": "pt"})
    os.replace(tmp, written[0])
    if hf:
        cfg = dict(hf["config"])
        cfg.setdefault("architectures", [hf["class"]])
        if dtype is not None:
            cfg["dtype"] = str(dtype).replace("torch.", "")
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        written.append(out / "config.json")
    fsync_dir(out)
    return written
