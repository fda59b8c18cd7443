"""hpZ: the secondary shard, and the gather inside the node from it. After a world
gather a rank keeps the pieces of its column (the note); a later gather of the unit
(the backward's) runs from them inside the hpZ group, crossing no node boundary.
`issue` / `finish` are also the second stage of the hierarchical gather and of qWD.

[Note: the secondary shard's layout]
With hpZ groups of P ranks, rank r (index i = r mod P in its group) keeps the primary shards of the
W/P ranks k*P + i, k = 0..W/P-1, as its *secondary* (piece k = rank k*P+i's shard). For P = D these
are the ranks sharing r's local index, one per node: exactly the inter-node group, so a hierarchical
gather's first stage (an all-gather in that group) outputs the secondary itself, with no copy, and
the owner of a primary shard and every holder of a copy of it are one inter-node group, which qWD's
deltas travel in. A gather from secondaries (inside the hpZ group) receives the pieces in (i, k)
order and places piece (i, k) at slot k*P + i: the same bytes a world gather puts there. The
secondary holds wire bytes when the weights travel quantized (qwZ: the bytes as received; qWD's
copies are these), else weights at the compute dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..collectives import Comm, Pending
from ..quant import dequantize_pieces

if TYPE_CHECKING:
    from . import WeightSpec


class Secondary:
    """This rank's secondary shard and the master version it stands for: the one
    place that state changes. `persists` (qWD): kept across optimizer steps, a
    delta due after each; otherwise dropped by a step."""

    def __init__(self, p: int, index: int, *, persists: bool) -> None:
        self.p, self.index, self.persists = p, index, persists
        self.pieces: Optional[torch.Tensor] = None  # W/P pieces, flat
        self._current: Optional[tuple] = None  # master version the pieces stand for
        self._stepped: Optional[tuple] = None  # master version right after the last step

    def current_for(self, version: tuple) -> bool:
        return self.pieces is not None and self._current == version

    def delta_due(self, version: tuple) -> bool:
        return self.pieces is not None and self._stepped == version

    def set(self, pieces: torch.Tensor, version: tuple) -> None:
        self.pieces, self._current, self._stepped = pieces, version, None

    def keep(self, gathered: torch.Tensor, world_size: int, version: tuple) -> None:
        """After a world gather: keep this rank's pieces k*P + i of the result."""
        mine = gathered.view(-1, self.p, gathered.numel() // world_size)[:, self.index]
        self.set(mine.clone().view(-1), version)

    def invalidate(self) -> None:
        self.pieces = self._current = self._stepped = None

    def after_step(self, version: tuple) -> None:
        """A step updated the master shard: qWD keeps the copies (a delta due), hpZ drops them."""
        if self.persists and self.pieces is not None:
            self._stepped, self._current = version, None
        else:
            self.invalidate()

    def before_step(self, version: tuple) -> None:
        """A master shard changed, not by a step, since the copies were current: full refresh."""
        if self.pieces is not None and version not in (self._current, self._stepped):
            self.invalidate()

    def start_delta(self) -> tuple:
        """A delta is being sent: until it is applied (`set` again), the copies are
        mid-update (the owner's piece moved at the encode), so a failure leaves a full
        refresh due rather than a resend. Returns the version the copies will stand for."""
        version, self._stepped = self._stepped, None
        return version

    def state(self, version: tuple) -> dict[str, torch.Tensor]:
        """The copies and whether a delta is due ({} if stale: the next gather is a full one)."""
        due = self._stepped == version
        if self.pieces is None or not (due or self._current == version):
            return {}
        # (the second number, deltas since a full refresh, is unused: kept 0 for the format)
        return {"secondary": self.pieces.detach().cpu(), "delta_due": torch.tensor([int(due), 0])}

    def load_state(self, state: dict[str, torch.Tensor], device: torch.device,
                   version: tuple) -> None:
        self.set(state["secondary"].to(device), version)
        if int(state["delta_due"][0]):
            self._stepped, self._current = version, None


def issue(spec: WeightSpec, comm: Comm, mine: torch.Tensor, op: str, group: str
          ) -> tuple[Pending, torch.Tensor]:
    """All-gather every member's pieces `mine` inside `group` (the hpZ group or the node)."""
    out = mine.new_empty(len(comm.ranks[group]) * mine.numel())
    return comm.all_gather(out, mine, op=op, group=group,
                           scale_bytes=spec.scale_bytes(spec.world_size)), out


def finish(spec: WeightSpec, out: torch.Tensor, full: torch.Tensor, g: int) -> None:
    """Member i's piece j (at i*k + j in `out`, k = W / g members) into slot j*g + i
    of `full`, dequantized when the pieces are wire bytes."""
    k = spec.world_size // g
    if spec.bits is not None:
        dequantize_pieces(out, full, pieces=g * k, bits=spec.bits, block=spec.block,
                          slots=[j * g + i for i in range(g) for j in range(k)])
    else:
        full.view(k, g, -1).copy_(out.view(g, k, -1).transpose(0, 1))
