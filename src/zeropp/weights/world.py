"""ZeRO-3's weight gather, and qwZ's INT8 payload on it: one ring all-gather over
the world, (W-1)/W of the payload per node across its boundary."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..collectives import Comm, Pending
from ..quant import dequantize_pieces, quantize
from . import hpz

if TYPE_CHECKING:
    from . import WeightPath


def send(path: WeightPath) -> torch.Tensor:
    """This rank's contribution to a full gather: its primary shard in the
    compute dtype or, with qwZ, quantized (payload and scales in one buffer)."""
    f = path.flat
    shard = f.primary_shard.detach()
    if f.int_storage:
        return shard
    if f.quantized_gather:
        return quantize(shard, f.weight_bits, f.block).to_bytes()
    return shard.to(f.compute_dtype)


def gather_buffer(path: WeightPath, pieces: int) -> tuple[torch.Tensor, int]:
    f = path.flat
    if f.quantized_gather:
        return (torch.empty(pieces * path.wire_bytes, dtype=torch.uint8,
                            device=f.full.device), path.scale_bytes * pieces)
    return torch.empty(pieces * f.shard_numel, dtype=f.compute_dtype,
                       device=f.full.device), 0


def issue(path: WeightPath, comm: Comm, op: str) -> Pending:
    """Every rank's primary shard (qwZ: as INT8 wire bytes, dequantized on
    arrival) into `full`; with hpZ the rank then keeps its pieces (hpz.keep)."""
    f = path.flat
    w = f.world_size
    if f.quantized_gather:
        out, scales = gather_buffer(path, w)

        def then() -> None:
            dequantize_pieces(out, f.full, pieces=w, bits=f.weight_bits, block=f.block)
            hpz.keep(path, out, wire=True)
        return comm.all_gather(out, send(path), op=op, group="world", scale_bytes=scales,
                               then=then)
    return comm.all_gather(f.full, send(path), op=op, group="world",
                           then=lambda: hpz.keep(path, f.full, wire=False))
