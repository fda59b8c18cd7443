"""Topology: node-major rank map and the world / intra-node / inter-node groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zeropp
from zeropp.cli.launch import WorkerError, spawn
from zeropp.topology import Topology


def test_node_major_rank_map_for_2_nodes_of_4():
    t = Topology(world_size=8, rank=5, node_size=4)
    assert (t.num_nodes, t.node, t.local_rank) == (2, 1, 1)
    assert t.intra_node_ranks() == [4, 5, 6, 7]
    assert t.inter_node_ranks() == [1, 5]


def test_single_process_topology_needs_no_process_group():
    t = zeropp.get_topology()
    assert (t.world_size, t.rank, t.node_size, t.num_nodes) == (1, 0, 1, 1)


def _group_sums():
    topo = zeropp.get_topology()  # node size from LOCAL_WORLD_SIZE
    out = {}
    for name, g in [("world", topo.world_group), ("intra", topo.intra_node_group),
                    ("inter", topo.inter_node_group)]:
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=g)
        out[name] = t.item()
    return topo.node, topo.local_rank, out


def test_groups_connect_the_right_ranks_at_3_nodes_of_2():
    res = spawn(_group_sums, 6, 2, timeout=120)
    for r, (node, local, sums) in enumerate(res):
        assert (node, local) == (r // 2, r % 2)
        assert sums["world"] == sum(range(6))
        assert sums["intra"] == 2 * node + (2 * node + 1)      # ranks of my node
        assert sums["inter"] == local + (local + 2) + (local + 4)  # my local index on each node


def _bad_node_size():
    zeropp.shard(torch.nn.Linear(2, 2), zeropp.Config(node_size=3))


def test_node_size_not_dividing_world_is_a_clear_error():
    with pytest.raises(WorkerError, match="node_size=3 must divide the world size 4"):
        spawn(_bad_node_size, 4, 2, timeout=60)


def test_a_group_with_different_numbers_of_ranks_per_node_is_refused_by_name():
    """topology.group_topology's check on every group of a mesh dimension (torch's
    groups list their ranks in ascending order): ranks 0, 1 on node 0 and 2 alone on
    node 1 cannot run node-by-node routes."""
    from zeropp.fsdp2.groups import _sub
    with pytest.raises(ValueError, match=r"the process group of ranks \[0, 1, 2\] is not "
                                         r"laid out node by node over nodes of 2 ranks"):
        _sub([0, 1, 2], 2)
    t = _sub([1, 3, 5, 7], 4)  # e.g. a dp group of TP=2 on 2 nodes x 4
    assert (t.world_size, t.node_size, t.num_nodes, t.global_rank(2)) == (4, 2, 2, 5)


def _dp_group_topology() -> tuple:
    from torch.distributed.device_mesh import init_device_mesh

    from zeropp.fsdp2.groups import group_topology
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    t = group_topology(mesh["dp"].get_group(), 4)
    return (t.rank, t.world_size, t.node_size, t.members,
            dist.get_process_group_ranks(t.intra_node_group),
            dist.get_process_group_ranks(t.inter_node_group))


def test_a_dp_group_of_tp_2_on_2_nodes_of_4_gets_its_own_node_groups():
    """W=8 as 2 x 4, TP=2: rank r's dp group is r%2, r%2+2, r%2+4, r%2+6, two ranks
    per node; its intra-node group is its node's two, its inter-node group the ranks
    at its position on the other node."""
    for r, (rank, w, d, members, intra, inter) in enumerate(
            spawn(_dp_group_topology, 8, 4, timeout=120)):
        dp = [r % 2 + 2 * k for k in range(4)]
        assert (rank, w, d, list(members)) == (dp.index(r), 4, 2, dp)
        node = r // 4
        assert intra == [m for m in dp if m // 4 == node]
        assert inter == [m for m in dp if dp.index(m) % 2 == dp.index(r) % 2]
