"""qWD: secondaries kept across optimizer steps, moved by deltas (the routes note);
then the gather inside the node (hpz.py).

[Note: qWD's copies]
The copies are qwZ's INT8 blocks of the masters (ZeRO++'s INT8 secondary), moved by qwd.py's
code deltas. The route depends only on state every rank shares (version counters, steps), so
every rank issues the same collectives in the same order on each group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import qwd
from ..collectives import Comm, Pending

if TYPE_CHECKING:
    from . import WeightSpec


def issue(spec: WeightSpec, comm: Comm, op: str, shard: torch.Tensor, own_copy: torch.Tensor
          ) -> tuple[Pending, torch.Tensor]:
    """The owner moves its copy of its shard to qwZ's INT8 of `shard` and
    all-gathers how the codes moved to the shard's holders (the inter-node group)."""
    n = spec.world_size // comm.topo.node_size
    send = own_copy.new_empty(qwd.wire_bytes(spec.shard_numel, spec.block), dtype=torch.uint8)
    qwd.encode(shard, own_copy, send, block=spec.block)
    out = send.new_empty(n * send.numel())
    return comm.all_gather(out, send, op=op, group="inter_node",
                           scale_bytes=n * qwd.meta_bytes(spec.shard_numel, spec.block)), out


def finish(spec: WeightSpec, out: torch.Tensor, copies: torch.Tensor, own: int) -> None:
    """Every holder moves its copy of each other owner's shard by that owner's delta
    (piece `own` is this rank's, moved at the encode): the same ops on every holder."""
    for k, piece in enumerate(out.view(len(copies), -1)):
        if k != own:
            qwd.apply(copies[k], piece, numel=spec.shard_numel, block=spec.block)
