"""ZeRO-3's gradient route: one ring reduce-scatter over the world."""

from __future__ import annotations

import torch

from ..collectives import Comm


class RingReduce:
    """Sum over the world in `reduce_dtype`, then the mean in fp32. A narrower
    reduce dtype divides first: a low-precision sum of W gradients may overflow."""

    codec = None  # no state to checkpoint

    def __init__(self, reduce_dtype: torch.dtype) -> None:
        self.reduce_dtype = reduce_dtype

    def first(self, comm: Comm, g: torch.Tensor) -> torch.Tensor:
        """The whole reduce-scatter: this rank's chunk of the mean, fp32."""
        w, rd = comm.topo.world_size, self.reduce_dtype
        g = g.to(rd) if rd == torch.float32 else g.to(rd) / w
        part = comm.reduce_scatter_sum(g, op="reduce_scatter").float()
        return part.div_(w) if rd == torch.float32 else part

    def second(self, comm: Comm, part: torch.Tensor) -> torch.Tensor:
        return part  # nothing left for the second stage

    def reduce(self, comm: Comm, g: torch.Tensor) -> torch.Tensor:
        return self.second(comm, self.first(comm, g))
