"""`zeropp export CKPT OUT`: a checkpoint's consolidated weights as one
model.safetensors under the original names (and, for a transformers model, its
config.json, so `from_pretrained(OUT)` works). Reads the checkpoint's files alone, no
process group (`consolidate`; deepspeed/zero_to_fp32.py uses it too)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional

import torch

from ..checkpoint_files import (
    CheckpointError,
    Reader,
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


def consolidate(path: os.PathLike, *, optimizer_state: bool = False,
                trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint's full tensors by original name, from its files alone: fp32 parameters and
    buffers, or with `optimizer_state` "<name>/<key>" per sharded optimizer-state tensor (e.g.
    exp_avg). Tied names share one tensor, as in a state dict. `trainable_only`: no frozen ones."""
    path = resolve(path)
    man = read_manifest(path)
    rd = Reader(path, man)
    out: dict[str, torch.Tensor] = {}
    for f in man["flats"]:
        if trainable_only and not f["trainable"]:
            continue
        keys = {f"model/{f['name']}": ""}  # the tensor to read: the suffix of its names
        if optimizer_state:
            st = (man.get("optimizer") or {}).get("state", {}).get(f["name"], {})
            keys = {f"optim/{f['name']}/{k}": f"/{k}" for k, v in st.items() if v == "sharded"}
        for key, suffix in keys.items():
            flat = rd.values(f, key, 0, f["numel"])
            for p in f["params"]:
                t = flat[p["offset"]:p["offset"] + math.prod(p["shape"])].view(p["shape"]).clone()
                for n in p["names"]:
                    out[n + suffix] = t
    if not optimizer_state:
        for name in man.get("buffers", {}):
            out[name] = rd.get(0, f"buffer/{name}")
    return out
