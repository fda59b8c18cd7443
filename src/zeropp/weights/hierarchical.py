"""The hierarchical gather: stage 1 across nodes among the ranks of this local
index (its output is the secondary, with hpZ at the node size), stage 2 inside
the node. (N-1)/N of the payload per node crosses, where a world ring sends
(W-1)/W. Stage 2 is issued and waited when stage 1 is waited for: issued any
earlier (when stage 1 completes), ranks could reach the intra-node group in
different orders, and a collective matched against another one hangs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..collectives import Comm, Pending
from ..quant import dequantize_pieces
from . import hpz
from .world import gather_buffer, send

if TYPE_CHECKING:
    from . import WeightPath


def issue(path: WeightPath, comm: Comm, op: str) -> Pending:
    """Hierarchical stage 1: the N primary shards of this rank's local index,
    across nodes; its output is the secondary (hpZ at the node size)."""
    n = path.flat.world_size // comm.topo.node_size
    out, scales = gather_buffer(path, n)

    def then() -> None:
        f = path.flat
        wire = f.quantized_gather
        mine, bits = out, (f.weight_bits if wire else None)
        if path.p > 1:
            if path.recodes:  # the copies are weights, or codes of other bits
                mine, bits = (dequantized(path, out, n) if wire else out), None
                if path.copy_bits is not None:
                    mine, bits = hpz.as_codes(path, mine.view(n, -1)), path.copy_bits
            hpz.set_secondary(path, mine)  # qWD's INT8 copies: qwZ's pieces as they came
        hpz.issue_inner(path, comm, mine, f"{op}/intra", "intra_node", bits).wait()
    return comm.all_gather(out, send(path), op=f"{op}/inter", group="inter_node",
                           scale_bytes=scales, then=then)


def dequantized(path: WeightPath, wire: torch.Tensor, pieces: int) -> torch.Tensor:
    f = path.flat
    out = torch.empty(pieces * f.shard_numel, dtype=f.compute_dtype, device=wire.device)
    dequantize_pieces(wire, out, pieces=pieces, bits=f.weight_bits, block=f.block)
    return out
