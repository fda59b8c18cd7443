"""FlatParam: one unit's parameters flattened into one buffer and cut into W shards.

A unit's parameters of one kind (trainable or frozen, one compute dtype) are
concatenated in a fixed order, zero-padded to a multiple of W, and cut into W
equal *primary shards*. Rank r keeps shard r in fp32 as an `nn.Parameter`: the
master weights the optimizer updates. The full weights exist only between a
gather and the matching free.

[Note: how the full weights reach the module and come back in backward]
`full` is one flat buffer whose storage is allocated for a gather and resized
to zero bytes to free it; the same storage object lives on, so tensors that
autograd saved in forward (views of it) see the weights again once backward
re-gathers into it. Each iteration makes `leaf = full.data`: a leaf tensor on
that storage with a version counter of its own, so the collective writing
into `full` before backward does not trip autograd's in-place check. The
module's parameters become views `leaf.split(...)` set as plain attributes;
autograd sums all their gradients into `leaf.grad` (one flat buffer, padding
included as zeros) and fires our post-accumulate hook once per backward: the
natural moment to reduce-scatter the unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from .collectives import Comm, Pending


@dataclass
class ParamInfo:
    """One original parameter: where it sits in the flat buffer and who holds it."""

    fqns: list[str]                     # every name it is reachable under (tied: several)
    registrations: list[tuple[nn.Module, str]]
    shape: torch.Size
    numel: int
    offset: int


class FlatParam:
    def __init__(self, params: list[tuple[nn.Parameter, list[tuple[nn.Module, str]], list[str]]],
                 *, rank: int, world_size: int, compute_dtype: torch.dtype,
                 trainable: bool) -> None:
        self.trainable, self.compute_dtype = trainable, compute_dtype
        self.world_size = world_size
        self.infos: list[ParamInfo] = []
        offset = 0
        for p, regs, fqns in params:
            self.infos.append(ParamInfo(fqns, regs, p.shape, p.numel(), offset))
            offset += p.numel()
        self.numel = offset
        # At least one element per rank, so an all-empty unit needs no special case.
        self.shard_numel = max(1, math.ceil(self.numel / world_size))
        self.padded_numel = self.shard_numel * world_size
        self.split_sizes = [i.numel for i in self.infos] + [self.padded_numel - self.numel]
        device = params[0][0].device
        with torch.no_grad():
            flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
            for (p, _, _), info in zip(params, self.infos):
                flat[info.offset:info.offset + info.numel].copy_(p.detach().reshape(-1))
            lo = rank * self.shard_numel
            self.primary_shard = nn.Parameter(flat[lo:lo + self.shard_numel].clone(),
                                              requires_grad=trainable)
        del flat
        self.full = torch.empty(self.padded_numel, dtype=compute_dtype, device=device)
        self._install_views(self.full)  # placeholders, so modules keep their attributes
        self.leaf: Optional[torch.Tensor] = None
        self.pending: Optional[Pending] = None
        self.gathered = False
        self.needs_reduce = False
        self.on_grad_ready: Optional[Callable[[FlatParam], None]] = None
        self._free_storage()

    # ---- gather / free -------------------------------------------------------
    def issue_gather(self, comm: Comm, *, op: str) -> bool:
        """Start gathering the full weights; False if gathered or in flight."""
        if self.gathered or self.pending is not None:
            return False
        self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
        shard = self.primary_shard.detach().to(self.compute_dtype)
        self.pending = comm.all_gather(self.full, shard, op=op)
        return True

    def wait_gather(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            self.gathered = True

    def free(self) -> None:
        self.wait_gather()
        if self.gathered:
            self._free_storage()
            self.gathered = False

    def _free_storage(self) -> None:
        self.full.untyped_storage().resize_(0)

    # ---- views ---------------------------------------------------------------
    def new_iteration(self) -> None:
        self.leaf = None

    def use_views(self) -> None:
        """Point the module attributes at views of the gathered weights (see the note)."""
        if self.leaf is None:
            self.leaf = self.full.data
            if self.trainable:
                self.leaf.requires_grad_(True)
                self.leaf.register_post_accumulate_grad_hook(self._grad_ready)
        if self.trainable and torch.is_grad_enabled():
            self.needs_reduce = True
        self._install_views(self.leaf)

    def _install_views(self, base: torch.Tensor) -> None:
        for info, v in zip(self.infos, base.split(self.split_sizes)):
            v = v.view(info.shape)
            for mod, attr in info.registrations:
                mod.__dict__[attr] = v  # plain attribute: the Parameter was removed

    def _grad_ready(self, leaf: torch.Tensor) -> None:
        if self.on_grad_ready is not None:
            self.on_grad_ready(self)

    # ---- gradients -----------------------------------------------------------
    def reduce_grad(self, comm: Comm, reduce_dtype: torch.dtype) -> None:
        """Reduce-scatter this iteration's full gradient to the mean over W and
        add it to the primary shard's `.grad` (accumulating micro-batches)."""
        self.needs_reduce = False
        g = None if self.leaf is None else self.leaf.grad
        if g is None:  # no gradient reached us: contribute zeros, keep ranks in step
            g = torch.zeros(self.padded_numel, dtype=reduce_dtype, device=self.full.device)
        else:
            self.leaf.grad = None
            g = g.to(reduce_dtype)
        w = self.world_size
        if reduce_dtype != torch.float32:
            g = g / w  # pre-divide: a low-precision sum of W gradients may overflow
        part = comm.reduce_scatter_sum(g, op="reduce_scatter").float()
        if reduce_dtype == torch.float32:
            part.div_(w)
        p = self.primary_shard
        if p.grad is None:
            p.grad = part
        else:
            p.grad.add_(part)

    # ---- consolidation -------------------------------------------------------
    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Original tensors (every name) from a full flat buffer."""
        out = {}
        for info in self.infos:
            t = flat[info.offset:info.offset + info.numel].view(info.shape)
            for fqn in info.fqns:
                out[fqn] = t
        return out
