"""ZeRO-3's weight gather, and qwZ's INT8 payload on it: one ring all-gather over the world
(the routes note); in the inter-node group, the hierarchical gather's first stage."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..collectives import Comm, Pending
from ..quant import dequantize_pieces, quantize

if TYPE_CHECKING:
    from . import WeightSpec


def issue(spec: WeightSpec, comm: Comm, op: str, shard: torch.Tensor, full: torch.Tensor,
          group: str = "world") -> tuple[Pending, torch.Tensor]:
    """Every `group` rank's primary shard: as wire bytes (qwZ: quantized here unless
    stored so), or at the compute dtype (the world's straight into `full`)."""
    n = len(comm.ranks[group])
    if spec.bits is not None:
        out = torch.empty(n * spec.wire_bytes, dtype=torch.uint8, device=full.device)
        send = shard if spec.stored_as_wire else quantize(shard, spec.bits, spec.block).to_bytes()
    else:
        out = full if group == "world" else full.new_empty(n * spec.shard_numel)
        send = shard.to(full.dtype)
    return comm.all_gather(out, send, op=op, group=group, scale_bytes=spec.scale_bytes(n)), out


def finish(spec: WeightSpec, out: torch.Tensor, full: torch.Tensor) -> None:
    """qwZ: every rank's piece dequantized into its slot of `full`."""
    if spec.bits is not None:
        dequantize_pieces(out, full, pieces=spec.world_size, bits=spec.bits, block=spec.block)
