"""The hierarchical gather's first stage (the routes note): across nodes among the ranks of
this local index, its output the secondary's N pieces; the second stage is hpz.py's."""

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
