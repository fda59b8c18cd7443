"""ZeRO-3's weight gather, and qwZ's INT8 payload on it: one ring all-gather over
the world, (W-1)/W of the payload per node across its boundary."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..collectives import Comm, Pending
from ..quant import dequantize_pieces, quantize

if TYPE_CHECKING:
    from . import WeightSpec


def send(spec: WeightSpec, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """This rank's contribution to a gather: its primary shard at the compute
    `dtype` or, with qwZ, quantized (payload and scales in one buffer)."""
    if spec.stored_as_wire:
        return shard
    if spec.bits is not None:
        return quantize(shard, spec.bits, spec.block).to_bytes()
    return shard.to(dtype)


def out_buffer(spec: WeightSpec, pieces: int, full: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A gather's output for `pieces` shards, and how many of its bytes are scales."""
    if spec.bits is not None:
        return (torch.empty(pieces * spec.wire_bytes, dtype=torch.uint8, device=full.device),
                spec.scale_bytes * pieces)
    return torch.empty(pieces * spec.shard_numel, dtype=full.dtype, device=full.device), 0


def issue(spec: WeightSpec, comm: Comm, op: str, shard: torch.Tensor, full: torch.Tensor
          ) -> tuple[Pending, torch.Tensor]:
    """Every rank's primary shard: as wire bytes (qwZ), or straight into `full`."""
    if spec.bits is None:
        return comm.all_gather(full, send(spec, shard, full.dtype), op=op, group="world"), full
    out, scales = out_buffer(spec, spec.world_size, full)
    return comm.all_gather(out, send(spec, shard, full.dtype), op=op, group="world",
                           scale_bytes=scales), out


def finish(spec: WeightSpec, out: torch.Tensor, full: torch.Tensor) -> None:
    """qwZ: every rank's piece dequantized into its slot of `full`."""
    if spec.bits is not None:
        dequantize_pieces(out, full, pieces=spec.world_size, bits=spec.bits, block=spec.block)
