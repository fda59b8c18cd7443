"""The hierarchical gather's first stage: across nodes among the ranks of this
local index. Its output is the N pieces of the secondary (with hpZ at the node
size, the secondary itself); the second stage, inside the node, is hpz.py's.
(N-1)/N of the payload per node crosses, where a world ring sends (W-1)/W."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..collectives import Comm, Pending
from .world import out_buffer, send

if TYPE_CHECKING:
    from . import WeightSpec


def issue(spec: WeightSpec, comm: Comm, op: str, shard: torch.Tensor, full: torch.Tensor
          ) -> tuple[Pending, torch.Tensor]:
    """The N primary shards of this rank's local index, across nodes."""
    out, scales = out_buffer(spec, spec.world_size // comm.topo.node_size, full)
    return comm.all_gather(out, send(spec, shard, full.dtype), op=op, group="inter_node",
                           scale_bytes=scales), out
