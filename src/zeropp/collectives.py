"""Every collective zeropp issues, each recorded in CommStats as it goes out: the plain
ones of ZeRO-3 and the payloads of the quantized ones (wire bytes); qgZ's hierarchical
reduce (grads/qgz.py) and the weight path (weights/) build on them.

[Note: counting bytes]
We count what this rank really puts on the wire under the algorithm that really runs,
and the part of it that leaves the node (docs/algorithms.md, "How bytes are counted").
Ranks are node-major, so a ring over a group visits each node's ranks in a row and
crosses a node boundary only where rank i's successor lives on another node:
- ring all-gather producing S bytes, or reduce-scatter of an S-byte input, over G ranks: each
  rank sends (G-1)/G * S, all of it inter-node if its ring successor is on another node, else
  none. A node therefore sends (G-1)/G * S across its boundary (one crossing).
- ring all-reduce: 2 * (G-1)/G * S per rank.
- all-to-all of an S-byte input over G ranks: S/G to each peer, inter-node exactly when the peer
  is on another node; nothing for the piece kept.
Scales are counted apart from payload, in the same proportion as they sit in the buffer. These rules
were checked against the emulated cluster's interface counters (within 0.3%).

[Note: reduce-scatter on gloo]
gloo's `reduce_scatter_tensor` is an all-reduce inside: twice the bytes of a real reduce-scatter. On
gloo we therefore run the ring ourselves with point-to-point sends (G-1 steps of S/G bytes), the
algorithm NCCL runs, so the ZeRO-3 baseline moves exactly what ZeRO-3 moves on a GPU cluster. On
NCCL the native `reduce_scatter_tensor` is that ring already.
"""

from __future__ import annotations

import atexit
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from .stats import CommStats, ring_send
from .topology import Topology, hpz_group

# torch 2.13 renamed the flat collectives (the old names warn); torch 2.4 has only those.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def collective_device() -> torch.device:
    """Where the default group's collectives take their tensors: the current CUDA device
    under NCCL (it moves only those), the host otherwise."""
    nccl = dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


class CollectiveError(RuntimeError):
    """A collective failed or outlived `Config.collective_timeout`; the message
    names the operation, the unit and the rank."""


EXIT_GRACE = 0.2  # seconds; the window it covers is a thread's scheduling delay
_made_gloo_comm = False  # a Comm on gloo groups exists or existed in this process


def _on_gloo() -> bool:
    return dist.is_available() and dist.is_initialized() and "gloo" in str(dist.get_backend())


@atexit.register
def _let_gloo_threads_finish() -> None:
    """At a normal exit (a torchrun rank returning from its script), give gloo's worker
    threads a moment, GIL free, to finish before the interpreter finalizes. A worker still
    holding a collective's tensors (done and waited, not yet released) frees them after the
    script's references are gone; that needs the GIL, and during finalization a thread
    taking it is ended inside C++: "terminate called without an active exception",
    SIGABRT, the rank reported failed after training (pytorch/pytorch#179291, #190489).
    Seen 1 in 14 W=4 torchrun runs of examples/deepspeed/transformer_lm.py on a loaded
    machine, once in a `make test`. Workers `spawn` starts leave with os._exit and skip
    this. Also after the script destroyed the default group: Comm may hold gloo subgroups."""
    if _on_gloo() or _made_gloo_comm:
        time.sleep(EXIT_GRACE)


class Pending:
    """An issued collective: `wait()` blocks until its output is ready (its input kept alive)."""

    def __init__(self, work: Any = None, keep: Any = None, comm: Optional[Comm] = None,
                 op: str = "") -> None:
        self._work, self._keep, self._comm, self._op = work, keep, comm, op
        self._unit = comm.unit if comm is not None else ""

    def wait(self) -> None:
        if self._work is not None:
            self._comm._wait(self._work, self._op, self._unit)
        self._work = self._keep = None


class Comm:
    """The collectives over this rank's groups ("world", "intra_node", "inter_node", "hpz"),
    recorded in `stats`; `groups`: other groups of those names (the reduce pipeline's)."""

    def __init__(self, topo: Topology, stats: CommStats, hpz_size: int = 1,
                 timeout: Optional[float] = None, groups: Optional[dict] = None) -> None:
        self.topo, self.stats, self.timeout = topo, stats, timeout
        global _made_gloo_comm
        _made_gloo_comm = _made_gloo_comm or _on_gloo()
        self.unit = "<none>"  # the unit whose collectives are being issued (for errors)
        self.groups = groups or {"world": topo.world_group, "intra_node": topo.intra_node_group,
                                 "inter_node": topo.inter_node_group}
        if hpz_size > 1:
            self.groups["hpz"] = hpz_group(topo, hpz_size)
        self.ranks = {g: topo.group_ranks(g, hpz_size) for g in self.groups}

    def _wait(self, work: Any, op: str, unit: Optional[str] = None) -> None:
        """Wait for `work` within the configured timeout; a failure names what hung
        (`unit`: the one that issued it, by default the one being issued)."""
        t, unit = self.timeout, self.unit if unit is None else unit
        try:
            work.wait() if t is None else work.wait(timedelta(seconds=t))
        except RuntimeError as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            limit = f" within the {t:g}s collective_timeout" if t is not None else ""
            raise CollectiveError(
                f"zeropp: {op} of unit {unit} did not complete{limit} on rank {self.topo.rank} "
                f"({why}); a rank may have died, or the ranks run different code") from None

    def _record_peers(self, op: str, group: str, peers: list[int], piece: int,
                      scale: int = 0) -> None:
        """`piece` bytes (`scale` of them scales) to each of `peers` but this rank."""
        for peer in peers:
            if peer != self.topo.rank:
                inter = self.topo.node_of(peer) != self.topo.node
                self.stats.record(op, group=group, sent=piece, inter=piece if inter else 0.0,
                                  scale=scale)

    def record_ring(self, op: str, group: str, nbytes: int, passes: int,
                    scale_bytes: int = 0) -> None:
        ranks = self.ranks[group]
        g = len(ranks)
        succ = ranks[(ranks.index(self.topo.rank) + 1) % g]
        sent = ring_send(nbytes, g, passes)
        crosses = self.topo.node_of(succ) != self.topo.node
        self.stats.record(op, group=group, sent=sent, inter=sent if crosses else 0.0,
                          scale=ring_send(scale_bytes, g, passes))

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, *, op: str,
                   group: str = "world", scale_bytes: int = 0) -> Pending:
        """Gather every group rank's `shard` into the flat `out` (group-rank
        order), asynchronously. `scale_bytes`: how much of `out` is scales."""
        self.record_ring(op, group, out.nbytes, 1, scale_bytes)
        if len(self.ranks[group]) == 1:
            out.copy_(shard)
            return Pending()
        work = _all_gather_flat(out, shard, group=self.groups[group], async_op=True)
        return Pending(work, keep=shard, comm=self, op=op)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, *, op: str, group: str,
                   scale_bytes_per_peer: int = 0) -> None:
        """Equal-split all-to-all of flat buffers: piece k of `inp` goes to group rank k."""
        ranks = self.ranks[group]
        self._record_peers(op, group, ranks, inp.nbytes // len(ranks), scale_bytes_per_peer)
        if len(ranks) == 1:
            out.copy_(inp)
            return
        self._wait(dist.all_to_all_single(out, inp, group=self.groups[group], async_op=True), op)

    def scatter(self, chunks: torch.Tensor, *, src: int, op: str) -> torch.Tensor:
        """Rank `src`'s `chunks` ([W, n], every rank passes its own: only src's are
        read) scattered over the world: chunk r to rank r; returns this rank's."""
        mine = self.topo.rank == src
        if mine:
            self._record_peers(op, "world", self.ranks["world"], chunks[0].nbytes)
        out = torch.empty_like(chunks[0])
        if self.topo.world_size == 1:
            return out.copy_(chunks[0])
        parts = list(chunks.contiguous().unbind(0)) if mine else None
        self._wait(dist.scatter(out, parts, src=self.topo.global_rank(src),
                                group=self.groups["world"], async_op=True), op)
        return out

    def reduce_scatter_sum(self, full: torch.Tensor, *, op: str) -> torch.Tensor:
        """Sum `full` (flat, W equal chunks) over the world; return this rank's chunk.
        `full` is consumed (gloo's ring sums into it)."""
        g, i = self.topo.world_size, self.topo.rank
        self.record_ring(op, "world", full.nbytes, 1)
        if g == 1:
            return full.clone()
        group = self.groups["world"]
        if dist.get_backend(group) == "nccl":
            out = torch.empty_like(full.view(g, -1)[0])
            self._wait(_reduce_scatter_flat(out, full, group=group, async_op=True), op)
            return out
        # Ring, in place: at step s rank i sends the partial sum of chunk (i-1-s) and receives that
        # of chunk (i-2-s), adds it to its chunk of `full` (consumed: the caller's gradient) and
        # sends that on; the last sum goes into the receive buffer, the one chunk-sized allocation
        # (51 MB at GPT-2 355M: the root's tied embedding), which is the result (own + received
        # equals received + own bitwise: IEEE addition commutes). gloo's send and recv read host
        # memory: with a CUDA tensor's pointer they fail in writev ("Bad address", gpu_check on an
        # H200 with torch 2.11), where its collectives stage through the host. So: a host copy.
        chunks = (full.cpu() if full.is_cuda else full).view(g, -1)
        right, left = self.topo.global_rank((i + 1) % g), self.topo.global_rank((i - 1) % g)
        send, recv = chunks[(i - 1) % g], torch.empty_like(chunks[0])
        for s in range(g - 1):
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, group),
                                             dist.P2POp(dist.irecv, recv, left, group)]):
                self._wait(w, op)
            mine = chunks[(i - 2 - s) % g]
            if s < g - 2:
                send = mine.add_(recv)
            else:
                recv.add_(mine)
        return recv.to(full.device)

    def all_reduce(self, t: torch.Tensor, *, op: str,
                   reduce_op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce of a small tensor (norms, flags) over the world."""
        self.record_ring(op, "world", t.nbytes, 2)
        if self.topo.world_size > 1:
            self._wait(dist.all_reduce(t, op=reduce_op, group=self.groups["world"],
                                       async_op=True), op)
        return t
