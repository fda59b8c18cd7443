"""Topology: who is where. World size W, ranks per node D, nodes N = W / D.

Ranks are numbered node-major, as torchrun numbers them: rank r lives on node
r // D at local index r % D. The process groups every technique needs are built
here once, collectively, in the same order on every rank:
- world: all W ranks (ZeRO-3's gather and reduce-scatter);
- intra_node: the D ranks of this rank's node (hpZ, qgZ's first hop);
- inter_node: the N ranks sharing this rank's local index (qgZ's second hop);
- hpz: the P consecutive ranks of this rank's hpZ partition (P = the
  `hpz_partition_size`; P = D, the usual choice, is the intra-node group).
Reductions run on two threads of their own, on duplicates of the first three
(`reduce_groups`; see grads/pipeline.py, "reductions on their own process groups").
World size 1 needs no process group at all.

[Note: a topology over a sub-group]
Under N-D parallelism (tensor parallel x FSDP, HSDP, an expert mesh) FSDP's group
is a sub-group of the world. `group_topology` gives it a Topology of its own: W
and the ranks are the group's (its group ranks), `members` maps them to global
ranks, and D is the group's ranks per node, found from the global ranks and the
launcher's node size. The group must be node-major in that sense (its ranks on
each node consecutive in group order, the same number on every node), as every
DeviceMesh dimension over torchrun's numbering is; its intra- and inter-node
groups are made for every group of its kind at once (new_group is collective
over the world).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    world_size: int
    rank: int
    node_size: int
    world_group: Any = None
    intra_node_group: Any = None
    inter_node_group: Any = None
    members: Optional[tuple[int, ...]] = None  # global ranks of a sub-group's ranks (the note)

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

    def hpz_ranks(self, size: int) -> list[int]:
        g = self.rank // size
        return list(range(g * size, (g + 1) * size))

    def group_ranks(self, group: str, hpz_size: int = 1) -> list[int]:
        """Global ranks of this rank's group named `group`, in group-rank order."""
        if group == "world":
            return list(range(self.world_size))
        if group == "intra_node":
            return self.intra_node_ranks()
        if group == "inter_node":
            return self.inter_node_ranks()
        if group == "hpz":
            return self.hpz_ranks(hpz_size)
        raise ValueError(f"unknown group {group!r}")


_CACHE: dict[tuple, Topology] = {}
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
    if topo.members is not None:
        raise ValueError(f"zeropp: on a sub-group, hpz_partition_size must be 1 or the "
                         f"group's ranks per node ({topo.node_size}), got {size}")
    key = (id(topo.world_group), size)
    if key not in _HPZ_CACHE:
        mine = None
        for g in range(topo.world_size // size):
            grp = dist.new_group(list(range(g * size, (g + 1) * size)))
            if g == topo.rank // size:
                mine = grp
        _HPZ_CACHE[key] = (topo.world_group, mine)  # holds WORLD so its id stays unique
    return _HPZ_CACHE[key][1]


_REDUCE_CACHE: dict[tuple, tuple] = {}


def reduce_groups(topo: Topology) -> dict[str, Any]:
    """World, intra-node and inter-node groups of the reduce pipeline: made once
    per layout (collective on first use, like get_topology), shared by every
    model on it, and each used by one communication thread only (grads/pipeline.py)."""
    if topo.world_size == 1:
        return {"world": None, "intra_node": None, "inter_node": None}
    key = (id(topo.world_group), topo.world_size, topo.node_size)
    if key not in _REDUCE_CACHE:  # holds WORLD so its id stays unique
        _REDUCE_CACHE[key] = (topo.world_group, _new_groups(topo))
    return _REDUCE_CACHE[key][1]


def _new_groups(topo: Topology) -> dict[str, Any]:
    world = dist.new_group(list(range(topo.world_size)))
    intra, inter = _node_groups(topo)
    return {"world": world, "intra_node": intra, "inter_node": inter}


def _node_groups(topo: Topology, mine: bool = True) -> tuple[Any, Any]:
    """This rank's new intra-node and inter-node groups (None, None where `mine` is
    False: another sub-group's). new_group is collective: every rank creates every
    group, in this order."""
    intra = inter = None
    for n in range(topo.num_nodes):
        g = dist.new_group([topo.global_rank(r) for r in topo.intra_node_ranks(n)])
        if mine and n == topo.node:
            intra = g
    for j in range(topo.node_size):
        g = dist.new_group([topo.global_rank(r) for r in topo.inter_node_ranks(j)])
        if mine and j == topo.local_rank:
            inter = g
    return intra, inter


def group_topology(group: Any, node_size: int) -> Topology:
    """The Topology of the process group `group` (see the note), built once per group
    layout. Collective over the world: every rank calls it, for its own group of the
    same kind (e.g. its dp group), in the same order. `node_size`: global ranks per
    node. A group that is not node-major is a ValueError naming it, on every rank."""
    world = dist.get_world_size()
    ranks = dist.get_process_group_ranks(group)
    every: list = [None] * world
    dist.all_gather_object(every, ranks)
    siblings = sorted({tuple(g) for g in every})
    key = ("group", tuple(siblings), node_size)
    if key in _CACHE:
        return _replace_group(_CACHE[key], group)
    tops = [_sub(list(g), node_size) for g in siblings]  # every rank checks every group
    made, me = None, dist.get_rank()
    for g, t in zip(siblings, tops):
        if me in g:
            t = dataclasses.replace(t, rank=g.index(me))
        intra, inter = _node_groups(t, mine=me in g)
        if me in g:
            made = dataclasses.replace(t, world_group=group, intra_node_group=intra,
                                       inter_node_group=inter)
    _CACHE[key] = made
    return made


def solo_group() -> Any:
    """A process group of this rank alone (collective on first use: every rank makes
    every rank's, in rank order)."""
    if "solo" not in _HPZ_CACHE:
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        _HPZ_CACHE["solo"] = groups[dist.get_rank()]
    return _HPZ_CACHE["solo"]


def _replace_group(topo: Topology, group: Any) -> Topology:
    return topo if topo.world_group is group else dataclasses.replace(topo, world_group=group)


def _sub(ranks: list[int], node_size: int) -> Topology:
    """A sub-group's shape (rank 0 of it, no process groups), checked node-major."""
    nodes = [r // node_size for r in ranks]
    counts = {n: nodes.count(n) for n in nodes}
    d = counts[nodes[0]]
    if len(set(counts.values())) > 1 or nodes != sorted(nodes):
        raise ValueError(
            f"zeropp: the process group of ranks {ranks} is not laid out node by node over "
            f"nodes of {node_size} ranks (its ranks' nodes: {nodes}): zeropp's routes need "
            "the same number of the group's ranks on every node, in node order")
    return Topology(len(ranks), 0, d, members=tuple(ranks))


def get_topology(node_size: Optional[int] = None) -> Topology:
    """The topology of the current default process group (built once per layout).

    `node_size` None reads LOCAL_WORLD_SIZE, which torchrun and zeropp's own
    launcher set (or LOCAL_SIZE, DeepSpeed's launcher's); without either all
    ranks are taken to share one node.
    """
    if not dist.is_available() or not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise RuntimeError(
                "zeropp: WORLD_SIZE > 1 but torch.distributed is not initialized; "
                "call torch.distributed.init_process_group() before zeropp.shard()")
        return Topology(world_size=1, rank=0, node_size=1)
    world, rank = dist.get_world_size(), dist.get_rank()
    if node_size is None:
        node_size = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
                        or world)
    if node_size < 1 or world % node_size != 0:
        raise ValueError(
            f"zeropp: node_size={node_size} must divide the world size {world} "
            f"(ranks per node; set Config.node_size or LOCAL_WORLD_SIZE)")
    key = (id(dist.group.WORLD), world, node_size)
    if key in _CACHE:
        return _CACHE[key]
    intra, inter = _node_groups(Topology(world, rank, node_size))
    topo = Topology(world, rank, node_size, dist.group.WORLD, intra, inter)
    _CACHE[key] = topo
    return topo
