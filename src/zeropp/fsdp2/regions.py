"""Which of an FSDP module's parameters may share a quantization block.

[Note: one model on every rank]
Under tensor parallel x FSDP every TP rank's dp group carries its own copy of the
parameters TP leaves whole (norms, a row-wise layer's bias, an unsharded head or
embedding); the copies stay equal only if every dp group turns equal inputs into equal
bytes. zeropp's codecs depend only on a buffer's values and their positions (no rank,
no randomness), but a block's scale is the absmax of its values, and FSDP2's flat chunk
puts a replicated LayerNorm beside a TP-sharded projection, whose values differ between
TP ranks: one block over both rounds the LayerNorm differently on each TP rank, and the
copies drift apart (bitwise from the first step; 0.1% apart in the outputs after 20).
So a module's chunk is cut into regions, one per *kind* of parameter (the mesh
dimensions beyond FSDP's over which its values differ; none for a replicated one), each
a buffer of its own with its own blocks, routes and error feedback: a block never holds
two kinds, and a region's bytes depend only on its own values. A module of one kind
(any 1-D mesh; HSDP; a block of experts alone) is one region, the whole chunk, bit for
bit as before. Weights always come with every parameter; gradients only for those that
have one, a set FSDP2 does not pass on: the trainable ones, or all. Any other set (a
parameter unused in this backward) travels as one region and says once that the copies
may then part; FSDP2's `set_reduce_scatter_unused_params(True)` passes a zero gradient
for such a parameter, so the chunk holds every trainable one again.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Union

import torch


@dataclass(frozen=True)
class Region:
    """The parameters of one kind: their spans (offset, numel) in a module's chunk."""

    kind: str
    spans: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return sum(n for _, n in self.spans)

    def take(self, src: torch.Tensor, width: int) -> torch.Tensor:
        """Rows of `src` (rows x chunk), packed into a new float32 rows x `width` (its
        columns past `numel` zero: a route's padding), flat."""
        dst = torch.empty(src.shape[0], width, dtype=torch.float32, device=src.device)
        dst[:, self.numel:] = 0
        pos = 0
        for off, n in self.spans:
            dst[:, pos:pos + n] = src[:, off:off + n]
            pos += n
        return dst.view(-1)

    def put(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The inverse of `take`: the first `numel` columns of `src` back into `dst`."""
        pos = 0
        for off, n in self.spans:
            dst[:, off:off + n] = src[:, pos:pos + n]
            pos += n


class Kinds:
    """A module's parameters (one FSDP parameter group), each with its kind and its
    size in the chunk (its padded shard), in FSDP2's order."""

    def __init__(self, group: Any, label: str) -> None:
        # FSDP's own mesh dims lead the sharded DTensor's, or under fully_shard(dp_mesh_dims=)
        # (an SPMD mesh, its dims in any order) are those named there, and those of FSDP's
        # own mesh: a tuple of names there is one flattened dim of it ("a_b") in the DTensor's
        info = group.mesh_info
        dims = getattr(info, "dp_mesh_dims", None)
        fsdp = {*dims.shard_names, *dims.replicate_names, *(info.mesh.mesh_dim_names or ())
                } if dims else info.mesh.ndim
        self.group = weakref.ref(group)  # (it holds the model, which the step hooks must not)
        self.sizes = [fp.padded_sharded_param_size.numel() for fp in group.fsdp_params]
        self.kinds = [kind_of(p, fsdp) for p in self.params]
        self.mixed = len(set(self.kinds)) > 1
        self.label, self.warned = label, False
        self._made: dict[tuple, tuple[Region, ...]] = {}  # by (chunk, trainable flags)

    def regions(self, chunk: int, grads: bool = False) -> tuple[Region, ...]:
        """The regions of a chunk of `chunk` elements: of every parameter (weights), or of
        those with a gradient (`grads`): the trainable ones, or all."""
        trainable = self.trained() if grads and self.mixed else None
        key = (chunk, trainable)
        if key not in self._made:
            self._made[key] = (self._cut(chunk, trainable) if self.mixed
                               else (Region("", ((0, chunk),)),))
        return self._made[key]

    def _cut(self, chunk: int, trainable: Any) -> tuple[Region, ...]:
        for present in [p for p in ([True] * len(self.sizes), trainable) if p is not None]:
            sizes = [n if keep else 0 for n, keep in zip(self.sizes, present)]
            if sum(sizes) == chunk:
                spans: dict[str, list] = {}
                for kind, off, n in zip(self.kinds, accumulate([0, *sizes]), sizes):
                    if n:
                        spans.setdefault(kind, []).append((off, n))
                return tuple(Region(k, tuple(s)) for k, s in sorted(spans.items()))
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"zeropp.fsdp2: module {self.label} passed a chunk of {chunk} elements that is "
                "neither all of its parameters nor its trainable ones (one unused in this "
                "backward?): it travels in shared quantization blocks, so the copies of its "
                "tensor-parallel-replicated parameters on different TP ranks may no longer be "
                "bitwise equal; model.set_reduce_scatter_unused_params(True) keeps them equal",
                stacklevel=4)
        return (Region("*", ((0, chunk),)),)

    def trained(self) -> tuple[bool, ...]:
        """Which parameters have a gradient (requires_grad), in FSDP2's order."""
        return tuple(p.requires_grad for p in self.params)

    def partial(self, chunk: int) -> bool:
        """Whether a gradient chunk of `chunk` elements holds only some of the trainable
        parameters (one unused in this backward): which ones, FSDP2 does not say, so its
        positions may hold other parameters than the last such chunk's."""
        trainable = sum(n for n, p in zip(self.sizes, self.params) if p.requires_grad)
        return chunk not in (sum(self.sizes), trainable)

    @property
    def params(self) -> list[torch.Tensor]:
        """The sharded parameters, read anew: `load_state_dict(assign=True)` replaces them."""
        group = self.group()
        return [fp.sharded_param for fp in group.fsdp_params] if group is not None else []


def kind_of(param: torch.Tensor, fsdp: Union[int, set[str]]) -> str:
    """The mesh dimensions beyond FSDP's (its first `fsdp`, or those named in `fsdp`) over
    which `param`'s values differ (its non-replicate placements there), e.g. "tp:S(0)";
    "" when none."""
    mesh, places = getattr(param, "device_mesh", None), getattr(param, "placements", ())
    names = (mesh.mesh_dim_names if mesh is not None else None) or ()
    name = [names[i] if i < len(names) else i for i in range(len(places))]
    own = [i < fsdp if isinstance(fsdp, int) else name[i] in fsdp for i in range(len(places))]
    return ",".join(f"{name[i]}:{p}" for i, p in enumerate(places)
                    if not own[i] and not p.is_replicate())
