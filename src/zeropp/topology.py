"""Topology: who is where. World size W, ranks per node D, nodes N = W / D.

Ranks are node-major, as torchrun numbers them: rank r is on node r // D at local index r % D. Every
technique's process groups are built here once, collectively, in the same order on every rank:
- world: all W ranks (ZeRO-3's gather and reduce-scatter);
- intra_node: the D ranks of this rank's node (hpZ, qgZ's first hop);
- inter_node: the N ranks sharing this rank's local index (qgZ's second hop);
- hpz: the P consecutive ranks of this rank's hpZ partition (P = the
  `hpz_partition_size`; P = D, the usual choice, is the intra-node group).
Reductions run on two threads of their own, on duplicates of the first three (`reduce_groups`;
grads/pipeline.py, "reductions on their own process groups"). World size 1 needs no process group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    world_size: int
    rank: int
    node_size: int
    world_group: Any = None
    intra_node_group: Any = None
    inter_node_group: Any = None
    members: Optional[tuple[int, ...]] = None  # a sub-group's ranks' global ranks (fsdp2/groups.py)

    def global_rank(self, rank: int) -> int:
        return rank if self.members is None else self.members[rank]

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.node_size

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.rank % self.node_size

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def intra_node_ranks(self, node: Optional[int] = None) -> list[int]:
        n = self.node if node is None else node
        return list(range(n * self.node_size, (n + 1) * self.node_size))

    def inter_node_ranks(self, local_rank: Optional[int] = None) -> list[int]:
        j = self.local_rank if local_rank is None else local_rank
        return [m * self.node_size + j for m in range(self.num_nodes)]

    def group_ranks(self, group: str, hpz_size: int = 1) -> list[int]:
        """The ranks of this rank's group named `group`, in group-rank order (ranks of
        this topology: global ones for the world's, `global_rank` maps a sub-group's)."""
        if group == "world":
            return list(range(self.world_size))
        if group == "intra_node":
            return self.intra_node_ranks()
        if group == "inter_node":
            return self.inter_node_ranks()
        if group == "hpz":
            g = self.rank // hpz_size
            return list(range(g * hpz_size, (g + 1) * hpz_size))
        raise ValueError(f"unknown group {group!r}")


_CACHE: dict[tuple, Any] = {}  # get_topology's, reduce_groups', fsdp2/groups.py's
_HPZ_CACHE: dict[tuple, Any] = {}


def hpz_group(topo: Topology, size: int) -> Any:
    """The process group of this rank's hpZ partition (collective on first use:
    every rank must ask for the same size in the same order)."""
    if topo.world_size % size:
        raise ValueError(f"zeropp: hpz_partition_size={size} must divide the world size "
                         f"{topo.world_size}")
    if size == topo.node_size:
        return topo.intra_node_group
    if topo.world_size == 1 or size == 1:
        return None
    if topo.members is not None:  # a sub-group's (fsdp2/groups.py)
        raise ValueError(f"zeropp: on a sub-group, hpz_partition_size must be 1 or the "
                         f"group's ranks per node ({topo.node_size}), got {size}")
    key = (id(topo.world_group), size)
    if key not in _HPZ_CACHE:  # the entry holds WORLD so its id stays unique
        groups = [dist.new_group(list(range(g * size, (g + 1) * size)))
                  for g in range(topo.world_size // size)]
        _HPZ_CACHE[key] = (topo.world_group, groups[topo.rank // size])
    return _HPZ_CACHE[key][1]


def reduce_groups(topo: Topology) -> dict[str, Any]:
    """World, intra-node and inter-node groups of the reduce pipeline: made once
    per layout (collective on first use, like get_topology), shared by every
    model on it, and each used by one communication thread only (grads/pipeline.py)."""
    if topo.world_size == 1:
        return {"world": None, "intra_node": None, "inter_node": None}
    key = ("reduce", id(topo.world_group), topo.world_size, topo.node_size)
    if key not in _CACHE:  # the entry holds WORLD so its id stays unique
        world = dist.new_group(list(range(topo.world_size)))
        intra, inter = _node_groups(topo)
        _CACHE[key] = (topo.world_group, {"world": world, "intra_node": intra, "inter_node": inter})
    return _CACHE[key][1]


def _node_groups(topo: Topology, mine: bool = True) -> tuple[Any, Any]:
    """This rank's new intra-node and inter-node groups (None, None where `mine` is False:
    another sub-group's). new_group is collective: every rank makes every group, in order."""
    def made(ranks: Callable[[int], list[int]], count: int, me: int) -> Any:
        groups = [dist.new_group([topo.global_rank(r) for r in ranks(i)]) for i in range(count)]
        return groups[me] if mine else None
    return (made(topo.intra_node_ranks, topo.num_nodes, topo.node),
            made(topo.inter_node_ranks, topo.node_size, topo.local_rank))


def get_topology(node_size: Optional[int] = None) -> Topology:
    """The topology of the current default process group (built once per layout).
    `node_size` None reads LOCAL_WORLD_SIZE, which torchrun and zeropp's own launcher set
    (or LOCAL_SIZE, DeepSpeed's launcher's); without either all ranks share one node."""
    if not dist.is_available() or not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise RuntimeError("zeropp: WORLD_SIZE > 1 but torch.distributed is not initialized; "
                               "call torch.distributed.init_process_group() before zeropp.shard()")
        return Topology(world_size=1, rank=0, node_size=1)
    world, rank = dist.get_world_size(), dist.get_rank()
    if node_size is None:
        node_size = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
                        or world)
    if node_size < 1 or world % node_size != 0:
        raise ValueError(f"zeropp: node_size={node_size} must divide the world size {world} "
                         "(ranks per node; set Config.node_size or LOCAL_WORLD_SIZE)")
    key = (id(dist.group.WORLD), world, node_size)
    if key not in _CACHE:  # the Topology holds WORLD so its id stays unique
        intra, inter = _node_groups(Topology(world, rank, node_size))
        _CACHE[key] = Topology(world, rank, node_size, dist.group.WORLD, intra, inter)
    return _CACHE[key]
