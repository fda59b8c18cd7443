"""hpZ: the secondary shard. After a world gather a rank keeps the pieces of its
column (the note), and a later gather of the unit (the backward's) runs inside
the hpZ group from them, without crossing a node boundary. Also the second
stage of the hierarchical gather and of qWD's refresh: `issue_inner`.

[Note: the secondary shard's layout]
With hpZ groups of P ranks, rank r (index i = r mod P in its group) keeps the
primary shards of the W/P ranks k*P + i, k = 0..W/P-1, as its *secondary*
(piece k = rank k*P+i's shard). For P = D these are the ranks sharing r's local
index, one per node: exactly the inter-node group, so the first stage of a
hierarchical gather (an all-gather in that group) outputs the secondary itself,
with no copy, and the owner of a primary shard and every holder of a copy of it
are one inter-node group, which is what qWD's deltas travel in. A gather from
secondaries (inside the hpZ group) receives the pieces in (i, k) order and
places piece (i, k) at slot k*P + i: the same bytes a world gather puts there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..collectives import Comm, Pending
from ..quant import QTensor, dequantize_pieces, quantize

if TYPE_CHECKING:
    from . import WeightPath


def issue(path: WeightPath, comm: Comm, op: str) -> Pending:
    """The gather from a current secondary, inside the hpZ group."""
    if path.copy_bits is not None:
        return issue_inner(path, comm, path.secondary, f"{op}/hpz", "hpz", path.copy_bits)
    return issue_inner(path, comm, path.secondary, f"{op}/hpz", "hpz",
                       path.flat.weight_bits if path.is_wire else None)


def keep(path: WeightPath, gathered: torch.Tensor, *, wire: bool) -> None:
    """hpZ after a world gather: keep this rank's pieces k*P + i of the result
    (wire bytes as received, qWD's INT8 copies, or its exact ones)."""
    if path.p == 1:
        return
    f = path.flat
    if path.recodes:
        gathered, wire = f.full, False  # take the copies from the full weights
    mine = gathered.view(-1, path.p, gathered.numel() // f.world_size)[:, path.index]
    if path.copy_bits is not None and not wire:
        set_secondary(path, as_codes(path, mine))
    else:
        set_secondary(path, mine.clone().view(-1))


def set_secondary(path: WeightPath, secondary: torch.Tensor) -> None:
    path.secondary, path.current_for, path.stepped_at = secondary, path.flat.version, None
    path.deltas = 0


def as_codes(path: WeightPath, pieces: torch.Tensor) -> torch.Tensor:
    """qWD's copies of weight `pieces` (n, shard) as wire bytes, one piece per shard."""
    f = path.flat
    wb = QTensor.wire_bytes(f.shard_numel, path.copy_bits, f.block)
    out = torch.empty(len(pieces) * wb, dtype=torch.uint8, device=pieces.device)
    for k, c in enumerate(pieces):
        quantize(c, path.copy_bits, f.block, out=out[k * wb:(k + 1) * wb])
    return out


def issue_inner(path: WeightPath, comm: Comm, mine: torch.Tensor, op: str, group: str,
                bits: Optional[int]) -> Pending:
    """Stage 2: all-gather every group member's pieces inside the group (hpZ
    group or node, G ranks) and place member i's piece k at slot k*G + i.
    `bits`: the pieces are wire bytes of that many bits (None: weights)."""
    f = path.flat
    g = len(comm.ranks[group])
    k = f.world_size // g
    out = torch.empty(g * mine.numel(), dtype=mine.dtype, device=mine.device)
    if bits is not None:

        def then() -> None:  # member i's piece j arrives at i*k + j, goes to slot j*g + i
            dequantize_pieces(out, f.full, pieces=g * k, bits=bits, block=f.block,
                              slots=[j * g + i for i in range(g) for j in range(k)])
        return comm.all_gather(out, mine, op=op, group=group,
                               scale_bytes=path.scale_bytes * g * k, then=then)

    def place() -> None:
        f.full.view(k, g, -1).copy_(out.view(g, k, -1).transpose(0, 1))
    return comm.all_gather(out, mine, op=op, group=group, then=place)
