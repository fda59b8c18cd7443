"""A flat buffer's master shard (flat_param.py, "zeropp's tensors"): made from its
parameters' values, and written from outside the optimizer (a state dict's load,
DeepSpeed's `safe_set_full_fp32_param`, `zeropp.gathered(modifier_rank=...)`), in
place: the version counter moves, so the secondaries see the change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from .deferred import materialize, release
from .layout import ShardLayout
from .quant import edit_wire, quantize

if TYPE_CHECKING:
    from .flat_param import FlatParam


@torch.no_grad()
def make(params: list[nn.Parameter], infos: list[Any], lay: ShardLayout, rank: int, *,
         sync: Optional[Callable[[torch.Tensor], None]], bits: Optional[int],
         trainable: bool) -> nn.Parameter:
    """Rank `rank`'s shard of `params`, each placed as its `infos` entry says (`bits`: stored
    as those wire bytes). `sync`: makes the flat buffer every rank's (a broadcast)."""
    flat = torch.zeros(lay.padded_numel, dtype=torch.float32, device=params[0].device)
    for p, info in zip(params, infos):
        # a deferred_init() one gets its values now, one at a time, and frees its storage
        flat[info.offset:info.offset + info.numel].copy_(materialize(p).reshape(-1))
        release(p)
    if sync is not None:
        sync(flat)
    shard: Any = flat[rank * lay.shard_numel:(rank + 1) * lay.shard_numel]
    if bits is not None:
        shard = quantize(shard, bits, lay.block).to_bytes()
    return nn.Parameter(shard.clone(), requires_grad=trainable)


def write_param(flat: FlatParam, i: int, value: torch.Tensor) -> None:
    """Parameter i's full value `value`: this rank's slice into its master shard."""
    write_range(flat, flat.infos[i].offset, value)


@torch.no_grad()
def write_range(flat: FlatParam, offset: int, value: torch.Tensor) -> None:
    """`value` (flattened) is the flat buffer's elements from `offset` on: this rank's
    slice of it into its master shard."""
    lo, n, size = flat.rank * flat.shard_numel, value.numel(), flat.shard_numel
    a, b = max(lo, offset), min(lo + size, offset + n)
    if a >= b:
        return
    piece = value.detach().reshape(-1)[a - offset:b - offset]
    if not flat.int_storage:
        flat.primary_shard[a - lo:b - lo] = piece  # in place: bumps the version counter
        return
    changed = torch.zeros(size, dtype=torch.bool, device=piece.device)
    changed[a - lo:b - lo] = True
    values = torch.zeros(size, dtype=torch.float32, device=piece.device)
    values[a - lo:b - lo] = piece
    write_shard(flat, values, changed)


@torch.no_grad()
def write_shard(flat: FlatParam, values: torch.Tensor, changed: torch.Tensor) -> None:
    """`values[changed]` into this rank's master shard (`changed`: a mask over it)."""
    p = flat.primary_shard
    if not flat.int_storage:
        p[changed] = values[changed].to(p.dtype)  # in place: bumps the version counter
        return
    p.copy_(edit_wire(p.detach(), values, changed, bits=flat.weight_bits, block=flat.block))
