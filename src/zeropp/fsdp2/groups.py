"""The topologies of the process groups FSDP2 hands zeropp's comms.

[Note: a topology over a sub-group]
Under N-D parallelism (tensor parallel x FSDP, HSDP, an expert mesh) FSDP's group is
a sub-group of the world. `group_topology` gives it a Topology of its own: W and the
ranks are the group's, `members` maps them to global ranks, and D is the group's
ranks per node, from the global ranks and the launcher's node size. The group must be
node-major (its ranks on each node consecutive in group order, the same number on
every node), as every DeviceMesh dimension over torchrun's numbering is; its intra-
and inter-node groups are made for every group of its kind at once (new_group is
collective over the world).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from ..topology import _CACHE, _HPZ_CACHE, Topology, _node_groups


def group_topology(group: Any, node_size: int) -> Topology:
    """The Topology of the process group `group` (see the note), built once per group
    layout. Collective over the world: every rank calls it, for its own group of the
    same kind (e.g. its dp group), in the same order. `node_size`: global ranks per
    node. A group that is not node-major is a ValueError naming it, on every rank."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, dist.get_process_group_ranks(group))
    siblings = sorted({tuple(g) for g in every})
    key = ("group", id(dist.group.WORLD), tuple(siblings), node_size)
    if key in _CACHE:
        made = _CACHE[key][1]
        return made if made.world_group is group else dataclasses.replace(made, world_group=group)
    tops = [_sub(list(g), node_size) for g in siblings]  # every rank checks every group
    made, me = None, dist.get_rank()
    for g, t in zip(siblings, tops):
        t = dataclasses.replace(t, rank=g.index(me)) if me in g else t
        intra, inter = _node_groups(t, mine=me in g)
        if me in g:
            made = dataclasses.replace(t, world_group=group, intra_node_group=intra,
                                       inter_node_group=inter)
    _CACHE[key] = (dist.group.WORLD, made)  # holds WORLD so its id stays unique
    return made


def solo_group() -> Any:
    """A process group of this rank alone (collective on first use: every rank makes
    every rank's, in rank order)."""
    key = ("solo", id(dist.group.WORLD))
    if key not in _HPZ_CACHE:
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        _HPZ_CACHE[key] = (dist.group.WORLD, groups[dist.get_rank()])
    return _HPZ_CACHE[key][1]


def _sub(ranks: list[int], node_size: int) -> Topology:
    """A sub-group's shape (rank 0 of it, no process groups), checked node-major."""
    nodes = [r // node_size for r in ranks]
    counts = {n: nodes.count(n) for n in nodes}
    if len(set(counts.values())) > 1 or nodes != sorted(nodes):
        raise ValueError(
            f"zeropp: the process group of ranks {ranks} is not laid out node by node over "
            f"nodes of {node_size} ranks (its ranks' nodes: {nodes}): zeropp's routes need "
            "the same number of the group's ranks on every node, in node order")
    return Topology(len(ranks), 0, counts[nodes[0]], members=tuple(ranks))
