"""The hierarchical gather's first stage: across nodes among the ranks of this local
index, its output the N pieces of the secondary (the routes note); the second stage,
inside the node, is hpz.py's. (N-1)/N of the payload per node crosses, not (W-1)/W."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..collectives import Comm, Pending
from . import world

if TYPE_CHECKING:
    from . import WeightSpec


def issue(spec: WeightSpec, comm: Comm, op: str, shard: torch.Tensor, full: torch.Tensor
          ) -> tuple[Pending, torch.Tensor]:
    """The N primary shards of this rank's local index: world.py's gather, across nodes."""
    return world.issue(spec, comm, op, shard, full, group="inter_node")
