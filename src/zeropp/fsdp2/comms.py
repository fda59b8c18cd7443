"""zeropp's collectives in FSDP2's custom-collective slots.

FSDP2 hands a module's all-gather an output buffer (W chunks of the module's
flat shard, in the parameter dtype) whose slot r is this rank's input, and its
reduce-scatter an input of W chunks (the reduce dtype) and a chunk to fill.
Only the output's contents are contracted; what travels is up to the comm:
- `WeightGather`: zero3 passes the chunks through (counted); qwZ quantizes the
  chunk to INT8 blocks (layout.py's rule), gathers the wire bytes and
  dequantizes every rank's piece into the output, this rank's own slot too, so
  every rank computes with the same weights; hpZ keeps this rank's column of
  those wire bytes (weights/hpz.py's layout) while the module's sharded weights
  are unchanged (version counters and optimizer steps), and the next gather
  (backward's) runs inside the hpZ group from them, bit for bit the same.
- `GradReduce`: zero3 is the ring reduce-scatter (collectives.py); qgZ runs
  grads/qgz.py's two hops, the route zeropp's own engine runs, with the
  module's own error-feedback state. Either returns the mean, scaled for the
  op FSDP2 asks for (AVG, SUM, PREMUL_SUM's factor).
Both are synchronous (they return None; FSDP2 then records its event).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ..collectives import Comm
from ..config import Config
from ..grads.qgz import QgzReduce
from ..layout import ShardLayout
from ..weights import WeightPath


class _Buffers:
    """`allocate`: FSDP2's buffers, plain tensors."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


def _check_group(comm: Comm, group: dist.ProcessGroup, what: str) -> None:
    if group.size() != comm.topo.world_size:
        raise NotImplementedError(
            f"zeropp.fsdp2: {what} over a group of {group.size()} ranks, not the world of "
            f"{comm.topo.world_size}: reshard_after_forward=int other than the node size, and "
            "HSDP meshes, are not supported yet; use True, False or the node size on a 1-D "
            "mesh")


class _Chunk:
    """One FSDP module's all-gather chunk, seen by zeropp's weight routes
    (weights/) as a flat buffer: this rank's chunk padded to whole blocks is the
    primary shard, `full` the W padded chunks. The routes read only these."""

    trainable, int_storage = True, False

    def __init__(self, cfg: Config, name: str, world_size: int,
                 version: Callable[[], tuple]) -> None:
        self.name, self.world_size, self._version = name, world_size, version
        self.quantized_gather, self.weight_bits = cfg.quantized_weights, cfg.weight_bits
        self.cfg = cfg
        self.layout: Optional[ShardLayout] = None
        self.primary_shard: Optional[torch.Tensor] = None
        self.full: Optional[torch.Tensor] = None
        self.compute_dtype: Optional[torch.dtype] = None

    @property
    def version(self) -> tuple:
        return self._version()

    def set_numel(self, numel: int) -> None:
        """The module's gathered size (W chunks): its layout."""
        if self.layout is None or self.layout.numel != numel:
            self.layout = ShardLayout.of(numel, self.world_size, self.cfg)
        self.block, self.shard_numel = self.layout.block, self.layout.shard_numel
        self.padded_numel = self.layout.padded_numel

    def take(self, chunk: torch.Tensor, out_dtype: torch.dtype) -> None:
        """This call's chunk (and the buffer the routes write the full weights into)."""
        self.set_numel(chunk.numel() * self.world_size)
        shard = torch.zeros(self.shard_numel, dtype=torch.float32, device=chunk.device)
        shard[:chunk.numel()] = chunk
        self.primary_shard, self.compute_dtype = shard, out_dtype
        self.full = torch.empty(self.padded_numel, dtype=out_dtype, device=chunk.device)


class WeightGather(_Buffers, AllGather):
    """zero3: FSDP2's own all-gather, counted. Otherwise the module's chunk goes
    through zeropp's weight routes (weights/: qwZ, hpZ, the hierarchical gather,
    qWD), the same the engine runs, and the full weights into FSDP2's output."""

    def __init__(self, comm: Comm, cfg: Config, label: str,
                 version: Callable[[], tuple]) -> None:
        self.comm, self.cfg, self.label = comm, cfg, label
        self.plain = not (cfg.quantized_weights or cfg.hpz_partition_size > 1
                          or cfg.hierarchical_gather)
        self.chunk = _Chunk(cfg, label, comm.topo.world_size, version)
        self.path = None if self.plain else WeightPath(self.chunk, comm.topo, cfg)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> None:
        self.comm.unit = self.label
        if (group.size() == self.comm.topo.node_size < self.comm.topo.world_size
                and dist.get_process_group_ranks(group) == self.comm.ranks["intra_node"]):
            # reshard_after_forward=node size: the backward's gather of FSDP2's own
            # post-forward shard (of the weights this comm gathered), inside the node
            self.comm.all_gather(output_tensor, input_tensor, op="all_gather/fsdp2/post_forward",
                                 group="intra_node").wait()
            return None
        _check_group(self.comm, group, "an all-gather")
        if self.plain:
            self.comm.all_gather(output_tensor, input_tensor, op="all_gather/fsdp2").wait()
            return None
        if output_tensor.dtype == torch.uint8:
            raise NotImplementedError(
                f"zeropp.fsdp2: module {self.label} mixes parameter dtypes (FSDP2 gathers them "
                "as bytes); zeropp's weight routes need one dtype per module")
        w, c = self.comm.topo.world_size, input_tensor.numel()
        self.chunk.take(input_tensor, output_tensor.dtype)
        self.path.issue(self.comm, "fsdp2").wait()
        output_tensor.view(w, c).copy_(self.chunk.full.view(w, -1)[:, :c])
        self.chunk.full = self.chunk.primary_shard = None
        return None


class GradReduce(_Buffers, ReduceScatter):
    def __init__(self, comm: Comm, cfg: Config, label: str) -> None:
        self.comm, self.cfg, self.label = comm, cfg, label
        self.route: Optional[QgzReduce] = None  # made at the first call (its block)

    def make_route(self, block: int) -> None:
        self.route = QgzReduce.from_config(self.cfg, block=block, topo=self.comm.topo,
                                           name=self.label)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> None:
        _check_group(self.comm, group, "a reduce-scatter")
        self.comm.unit = self.label
        w, c = self.comm.topo.world_size, output_tensor.numel()
        kind = getattr(op, "op", op)
        if kind == dist.ReduceOp.AVG:
            scale = 1.0 / w
        elif kind == dist.ReduceOp.SUM:
            scale = 1.0
        elif kind == dist.ReduceOp.PREMUL_SUM:
            scale = float(op.factor)
        else:
            raise NotImplementedError(f"zeropp.fsdp2: reduce-scatter op {op} is not supported "
                                      "(AVG, SUM and PREMUL_SUM are)")
        if not self.cfg.quantized_gradients:
            total = self.comm.reduce_scatter_sum(input_tensor, op="reduce_scatter/fsdp2")
            output_tensor.copy_(total if scale == 1.0 else total * scale)
            return None
        lay = ShardLayout.of(c * w, w, self.cfg)
        if self.route is None:
            self.make_route(lay.block)
        g = torch.zeros(w, lay.shard_numel, dtype=torch.float32, device=input_tensor.device)
        g[:, :c] = input_tensor.view(w, c)
        mean = self.route.reduce(self.comm, g.view(-1))  # the sum / W
        output_tensor.copy_(mean[:c] * (scale * w))
        return None
