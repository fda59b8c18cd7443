"""The weight path: how a flat buffer's full weights are assembled from the shards.

A driver (the engine's `FlatParam`, or FSDP2's all-gather slot) makes two calls per gather, as FSDP2
does with its all-gather and copy-out: `WeightPath.issue(comm, phase, shard, full)` starts the
route's first collective, `WeightPath.finish(gather)` waits for it, runs any second stage and leaves
the weights in `full`. A route is a pair of functions over tensors, one file per technique:
  world.py         ZeRO-3's ring all-gather over the world; qwZ's INT8 payload on it; in
                   the inter-node group, stage 1 of the two-stage (hierarchical) gather
  hpz.py           hpZ: the secondary shard (`Secondary`, its one owner), and stage 2
                   of every route that has one: the gather inside the node from it
  delta.py         qWD: the secondary kept across steps, moved by code deltas

[Note: routes]
  WORLD     ZeRO-3 / qwZ: one ring over the world (W-1)/W of the payload per node
            across; with hpZ the rank then keeps its pieces of the result.
  HIER      stage 1 across nodes among same-local-index ranks -> the N pieces of the
            secondary; stage 2 inside the node; (N-1)/N per node crosses; bitwise WORLD's.
  SECONDARY hpZ: stage 2 only, from a current secondary (nothing crosses nodes).
  DELTA     qWD: the secondary persists across steps. After a step each owner
            all-gathers a delta of its shard in the inter-node group, every holder
            (the owner too) applies it, copies bitwise identical; then stage 2.
Stage 2 is issued by `finish`, after stage 1 is waited for: issued earlier, ranks could
reach the intra-node group in different orders, and a collective matched wrongly hangs.

[Note: when qWD refreshes in full]
A full refresh (the HIER or WORLD route, qwZ's INT8) runs on the first gather, after a checkpoint
load at another layout, when the master shard changed by anything but a step (its version counter
moved after the step hook ran, or its storage was replaced), and after `zeropp.refresh(model)`. An
in-place write through `.data` is invisible to version counters: it reaches the copies through the
next delta (`zeropp.refresh(model)` sends it at once). Memory: the persistent secondary costs W/P
shards per rank (1/D of the model) as INT8 blocks, 1 byte/param / D, where qwZ+hpZ keeps the same
bytes only between a forward and the next step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch

from ..collectives import Comm, Pending
from ..layout import ShardLayout
from ..quant import QTensor
from . import delta, hpz, world

if TYPE_CHECKING:
    from ..config import Config
    from ..topology import Topology


class Route(enum.Enum):
    WORLD = "world"
    HIER = "hier"
    SECONDARY = "secondary"
    DELTA = "delta"


@dataclass(frozen=True)
class WeightSpec(ShardLayout):
    """A flat buffer's cut into W shards (layout.py) and how a shard travels: as
    `bits`-bit wire bytes, or at the compute dtype (`bits` None)."""

    bits: Optional[int] = None
    stored_as_wire: bool = False  # the primary shard is those wire bytes already

    @property
    def wire_bytes(self) -> int:
        """Bytes of one shard as wire bytes (scales and codes)."""
        return QTensor.wire_bytes(self.shard_numel, self.bits, self.block)

    def scale_bytes(self, pieces: int) -> int:
        """Bytes of the scales of `pieces` shards as they travel (0 at the compute dtype)."""
        return self.shard_numel // self.block * 4 * pieces if self.bits is not None else 0


@dataclass
class Gather:
    """A gather under way: its route and first collective, and where it lands."""

    route: Route
    phase: str                    # "forward", "backward", "fsdp2", ...: its ops' labels
    comm: Comm
    pending: Pending
    out: torch.Tensor             # the first collective's output
    full: torch.Tensor            # the full weights' buffer (compute dtype)
    shard: torch.Tensor           # this rank's primary shard, as sent
    version: tuple                # the master version the result stands for


class WeightPath:
    """One flat buffer's route choice and its secondary (hpZ / qWD)."""

    def __init__(self, spec: WeightSpec, topo: Topology, cfg: Config, *, trainable: bool,
                 version: Callable[[], tuple]) -> None:
        self.spec, self.version = spec, version
        w, d, p = topo.world_size, topo.node_size, cfg.hpz_partition_size
        # Two stages need a real node boundary; P must then be the node size (or
        # 1) so that stage 1 is the inter-node group (hpz.py, the layout note).
        self.hierarchical = cfg.hierarchical_gather and 1 < d < w
        self.delta = cfg.weight_delta and trainable and w // d > 1
        if (self.hierarchical or cfg.weight_delta) and p not in (1, d):
            raise ValueError(f"zeropp: hierarchical_gather / weight_delta need "
                             f"hpz_partition_size 1 or the node size {d}, got {p}")
        self.outer_index = topo.rank // d          # this rank's index in its inter-node group
        self.secondary = hpz.Secondary(p, topo.rank % p, persists=self.delta) if p > 1 else None

    def route(self) -> Route:
        sec, v = self.secondary, self.version()
        if sec is not None and sec.current_for(v):
            return Route.SECONDARY
        if sec is not None and sec.delta_due(v):
            return Route.DELTA
        return Route.HIER if self.hierarchical else Route.WORLD

    def issue(self, comm: Comm, phase: str, shard: torch.Tensor, full: torch.Tensor) -> Gather:
        """Start gathering every rank's `shard` (this one's primary shard, detached) into `full`."""
        route, op, spec = self.route(), f"all_gather/{phase}", self.spec
        version = self.version()  # what the result stands for, whatever happens meanwhile
        if route is Route.SECONDARY:
            pending, out = hpz.issue(spec, comm, self.secondary.pieces, f"{op}/hpz", "hpz")
        elif route is Route.DELTA:
            version = self.secondary.start_delta()
            copies = self.secondary.pieces.view(spec.world_size // self.secondary.p, -1)
            pending, out = delta.issue(spec, comm, f"{op}/delta", shard, copies[self.outer_index])
        elif route is Route.HIER:
            pending, out = world.issue(spec, comm, f"{op}/inter", shard, full, group="inter_node")
        else:
            pending, out = world.issue(spec, comm, op, shard, full)
        return Gather(route, phase, comm, pending, out, full, shard, version)

    def finish(self, gather: Gather) -> None:
        """Wait for `gather`'s first collective, run its second stage: the weights in `full`."""
        gather.pending.wait()
        spec, sec, out, full = self.spec, self.secondary, gather.out, gather.full
        if gather.route is Route.WORLD:
            world.finish(spec, out, full)
            if sec is not None:
                sec.keep(out, spec.world_size, gather.version)
            return
        if gather.route is Route.SECONDARY:
            return hpz.finish(spec, out, full, sec.p)
        if gather.route is Route.DELTA and sec.pieces is None:
            # The copies were dropped while the delta was in flight (zeropp.refresh, a
            # load): every rank did the same, so every rank gathers in full instead.
            return self.finish(self.issue(gather.comm, gather.phase, gather.shard, full))
        if gather.route is Route.HIER:
            if sec is not None:
                sec.set(out, gather.version)  # stage 1's output is the secondary
            mine, op, group = out, f"all_gather/{gather.phase}/intra", "intra_node"
        else:
            delta.finish(spec, out, sec.pieces.view(spec.world_size // sec.p, -1), self.outer_index)
            sec.set(sec.pieces, gather.version)  # the delta applied: current again
            mine, op, group = sec.pieces, f"all_gather/{gather.phase}/hpz", "hpz"
        pending, out = hpz.issue(spec, gather.comm, mine, op, group)
        pending.wait()
        hpz.finish(spec, out, full, len(gather.comm.ranks[group]))
