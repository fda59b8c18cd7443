"""`deepspeed.utils.zero_to_fp32` over zeropp's checkpoints: the consolidated
fp32 state dict of a checkpoint, read from its files alone (no process group),
as DeepSpeed's offline converter gives it for its own format.

A checkpoint directory is what `engine.save_checkpoint(DIR)` wrote: DIR/latest
names the tag, DIR/<tag> is a zeropp checkpoint (checkpoint_files.py). The
values are the fp32 master weights, bit for bit those `zeropp.full_state_dict`
gives; tied names share one tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..cli.export import consolidate


def _tag_dir(checkpoint_dir: os.PathLike, tag: Optional[str]) -> Path:
    if tag is None:
        latest = Path(checkpoint_dir) / "latest"
        if not latest.is_file():
            raise ValueError(f"Unable to find 'latest' file at {latest}")
        tag = latest.read_text().strip()
    path = Path(checkpoint_dir) / str(tag)
    if not path.is_dir():
        raise FileNotFoundError(f"Directory '{path}' doesn't exist")
    return path


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: os.PathLike,
                                             tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint's fp32 state dict (original names, on the CPU). `tag`:
    the checkpoint under `checkpoint_dir` (default: the one `latest` names).
    `lazy_mode` is accepted; the tensors are real either way."""
    path = _tag_dir(checkpoint_dir, tag)
    return consolidate(path, trainable_only=exclude_frozen_parameters)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: os.PathLike,
                                               output_dir: os.PathLike,
                                               max_shard_size: Any = "5GB",
                                               safe_serialization: bool = False,
                                               tag: Optional[str] = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """Write the checkpoint's fp32 state dict to `output_dir` as one
    `pytorch_model.bin` (or `model.safetensors` with `safe_serialization`),
    loadable by the unsharded model. `max_shard_size` is accepted; one file is
    written whatever the size."""
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag,
                                                  exclude_frozen_parameters)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if safe_serialization:
        from safetensors.torch import save_file
        save_file(unshared(sd), str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(sd, out / "pytorch_model.bin")


def unshared(sd: dict) -> dict:
    """`sd` with a contiguous tensor of its own under each name: safetensors refuses
    tensors that share memory (tied names)."""
    seen: set[int] = set()
    out = {}
    for k, v in sd.items():
        out[k] = v.clone(memory_format=torch.contiguous_format) if id(v) in seen else \
            v.contiguous()
        seen.add(id(v))
    return out


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: os.PathLike,
                                         tag: Optional[str] = None) -> nn.Module:
    """Load the checkpoint's fp32 weights into `model` (moved to the CPU first,
    as DeepSpeed does) and return it. For a zeropp-sharded model call it on every
    rank (each keeps its slice) or inside `GatheredParameters`."""
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(sd, strict=False)
    return model


def main(argv: Optional[list] = None) -> None:
    """`python -m zeropp.deepspeed.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR`."""
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint_dir")
    ap.add_argument("output_dir")
    ap.add_argument("-t", "--tag", default=None)
    ap.add_argument("--safe_serialization", action="store_true")
    ap.add_argument("--exclude_frozen_parameters", action="store_true")
    a = ap.parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(a.checkpoint_dir, a.output_dir,
                                               safe_serialization=a.safe_serialization,
                                               tag=a.tag,
                                               exclude_frozen_parameters=a.exclude_frozen_parameters)
    print(json.dumps({"written": str(a.output_dir)}))


if __name__ == "__main__":
    main()
