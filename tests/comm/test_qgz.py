"""qgZ's hierarchical quantized reduce-scatter returns the mean over W, within
the error the two hops' quantization steps allow, on every layout."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zeropp
from zeropp.cli.launch import spawn
from zeropp.collectives import Comm
from zeropp.grads.qgz import HopCodec, reduce_scatter_qgz
from zeropp.stats import CommStats

BLOCK, CHUNK = 64, 3 * 64  # each rank's chunk: 3 blocks


def _grad(rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s full gradient: heavy-tailed, with a different scale per block."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(world * CHUNK, generator=g, dtype=torch.float64)
    x *= torch.exp(2 * torch.randn(world * CHUNK // BLOCK, generator=g,
                                   dtype=torch.float64)).repeat_interleave(BLOCK)
    return x.float()


def _qgz(intra_bits: int, inter_bits: int):
    topo = zeropp.get_topology()
    comm = Comm(topo, CommStats())
    out = reduce_scatter_qgz(comm, _grad(dist.get_rank(), topo.world_size), block=BLOCK,
                             intra_bits=intra_bits, inter=HopCodec(inter_bits, BLOCK))
    return out, comm.stats.as_dict()


def _block_absmax(x: torch.Tensor) -> torch.Tensor:
    return x.view(-1, BLOCK).abs().amax(1).repeat_interleave(BLOCK)


def _bound(world: int, d: int, rank: int, intra_bits: int, inter_bits: int) -> torch.Tensor:
    """Worst-case |qgZ - exact mean| for rank `rank`'s chunk, from the inputs alone.
    Hop 1: each sender's value is off by at most half its block's step,
    absmax/(2 qmax1). Hop 2: the node-partial sum (exact sum + hop-1 error) is
    re-quantized with step <= (|partial| block absmax + hop-1 error) / qmax2.
    Both add up over the senders, then divide by W. Skipped hops add nothing."""
    n, q1, q2 = world // d, 2 ** (intra_bits - 1) - 1, 2 ** (inter_bits - 1) - 1
    grads = [_grad(r, world).double() for r in range(world)]
    mine = slice(rank * CHUNK, (rank + 1) * CHUNK)
    zero = torch.zeros(CHUNK, dtype=torch.float64)
    total = zero.clone()
    for m in range(n):
        node = [grads[m * d + k][mine] for k in range(d)]
        # per-block constants, so a block's absmax of hop1 is hop1 itself
        hop1 = sum(_block_absmax(x) / (2 * q1) for x in node) if d > 1 else zero
        hop2 = (_block_absmax(sum(node)) + hop1) / (2 * q2) if n > 1 else zero
        total += hop1 + hop2
    return total / world


@pytest.mark.parametrize("world,d", [(4, 2), (6, 2), (3, 1), (2, 2)],
                         ids=["2x2", "N=3", "D=1", "one-node"])
@pytest.mark.parametrize("bits", [(4, 4), (8, 4)], ids=["int4", "int8-intra"])
def test_qgz_is_the_mean_within_the_two_hop_bound(world, d, bits):
    out = spawn(_qgz, world, d, args=bits, timeout=120)
    exact = sum(_grad(r, world).double() for r in range(world)) / world
    for rank, (got, _) in enumerate(out):
        ref = exact[rank * CHUNK:(rank + 1) * CHUNK]
        err = (got.double() - ref).abs()
        bound = _bound(world, d, rank, *bits) + 1e-6 * ref.abs() + 1e-30
        assert bool((err <= bound).all()), (rank, (err - bound).max().item())
        if world > 1 and (d > 1 or world // d > 1):
            assert err.max() > 0  # it really quantized


def test_qgz_cross_node_bytes_are_n_minus_1_over_n_of_int4_values_plus_scales():
    """N=3 nodes of D=2: each rank sends N-1 of its N hop-2 pieces across, each
    CHUNK values at 4 bits plus one fp32 scale per block; hop 1 stays inside."""
    out = spawn(_qgz, 6, 2, args=(4, 4), timeout=120)
    piece = CHUNK // 2 + CHUNK // BLOCK * 4
    for _, stats in out:
        inter = stats["by_op"]["reduce_scatter/qgz/inter"]
        intra = stats["by_op"]["reduce_scatter/qgz/intra"]
        assert inter["inter_node_bytes"] == 2 * piece
        assert inter["scale_bytes"] == 2 * CHUNK // BLOCK * 4
        assert intra["inter_node_bytes"] == 0
        assert intra["intra_node_bytes"] == 3 * CHUNK // 2 + 3 * CHUNK // BLOCK * 4
