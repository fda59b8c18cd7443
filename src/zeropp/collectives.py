"""Every collective zeropp issues, each recorded in CommStats as it goes out.

[Note: counting bytes]
We count what this rank really puts on the wire under the algorithm that
really runs, and the part of it that leaves the node (SPEC.md, "Counting
bytes"). Ranks are node-major, so a ring over a group visits each node's ranks
in a row and crosses a node boundary only where rank i's successor lives on
another node:
- ring all-gather producing S bytes over G ranks: each rank sends (G-1)/G * S,
  all of it inter-node if its ring successor is on another node, else none.
  A node therefore sends (G-1)/G * S across its boundary (one crossing).
- ring reduce-scatter of an S-byte input: the same (G-1)/G * S per rank, the
  same crossing rule.
- ring all-reduce: 2 * (G-1)/G * S per rank.
These rules matched the emulated cluster's interface counters within 0.3%
(ENVIRONMENT.md).

[Note: reduce-scatter on gloo]
gloo's `reduce_scatter_tensor` is an all-reduce inside: twice the bytes of a
real reduce-scatter. On gloo we therefore run the ring ourselves with
point-to-point sends (G-1 steps of S/G bytes), the algorithm NCCL runs, so the
ZeRO-3 baseline moves exactly what ZeRO-3 moves on a GPU cluster. On NCCL the
native `reduce_scatter_tensor` is that ring already.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .stats import CommStats
from .topology import Topology

# torch 2.13 renamed the flat collectives (the old names warn); torch 2.4 has only those.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """An issued collective: `wait()` blocks until its output is ready. Keeps the
    input alive while the backend may still read it."""

    def __init__(self, work: Any = None, keep: Any = None) -> None:
        self._work, self._keep = work, keep

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
        self._work = self._keep = None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Comm:
    """The world-group collectives of ZeRO-3, recorded in `stats`."""

    def __init__(self, topo: Topology, stats: CommStats) -> None:
        self.topo, self.stats = topo, stats
        self.world_ranks = list(range(topo.world_size))
        succ = (topo.rank + 1) % topo.world_size
        # Whether this rank's ring successor is on another node (see the note).
        self._ring_crosses = topo.node_of(succ) != topo.node

    def _record_ring(self, op: str, nbytes: int, passes: int) -> None:
        g = self.topo.world_size
        sent = passes * (g - 1) / g * nbytes
        self.stats.record(op, group="world", sent=sent,
                          inter=sent if self._ring_crosses else 0.0)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, *, op: str) -> Pending:
        """Gather every rank's `shard` into the flat `out` (rank order), asynchronously."""
        self._record_ring(op, _nbytes(out), 1)
        if self.topo.world_size == 1:
            out.copy_(shard)
            return Pending()
        work = _all_gather_flat(out, shard, group=self.topo.world_group, async_op=True)
        return Pending(work, keep=shard)

    def reduce_scatter_sum(self, full: torch.Tensor, *, op: str) -> torch.Tensor:
        """Sum `full` (flat, W equal chunks) over ranks; return this rank's chunk."""
        g, i = self.topo.world_size, self.topo.rank
        self._record_ring(op, _nbytes(full), 1)
        if g == 1:
            return full.clone()
        chunks = full.view(g, -1)
        group = self.topo.world_group
        if dist.get_backend(group) == "nccl":
            out = torch.empty_like(chunks[0])
            _reduce_scatter_flat(out, full, group=group)
            return out
        # Ring: at step s rank i passes on the partial sum of chunk (i-1-s) and
        # receives that of chunk (i-2-s); after G-1 steps it holds chunk i.
        right, left = (i + 1) % g, (i - 1) % g
        acc, recv = chunks[(i - 1) % g].clone(), torch.empty_like(chunks[0])
        for s in range(g - 1):
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, acc, right, group),
                dist.P2POp(dist.irecv, recv, left, group)])
            for w in works:
                w.wait()
            acc = recv + chunks[(i - 2 - s) % g]
        return acc

    def all_reduce(self, t: torch.Tensor, *, op: str,
                   reduce_op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce of a small tensor (norms, flags)."""
        self._record_ring(op, _nbytes(t), 2)
        if self.topo.world_size > 1:
            dist.all_reduce(t, op=reduce_op, group=self.topo.world_group)
        return t
