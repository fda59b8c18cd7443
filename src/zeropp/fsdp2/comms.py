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
from ..quant import dequantize_pieces, quantize


class _Buffers:
    """`allocate`: FSDP2's buffers, plain tensors."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


def _check_group(comm: Comm, group: dist.ProcessGroup, what: str) -> None:
    if group.size() != comm.topo.world_size:
        raise NotImplementedError(
            f"zeropp.fsdp2: {what} over a group of {group.size()} ranks, not the world of "
            f"{comm.topo.world_size}: reshard_after_forward=int and HSDP meshes are not "
            "supported yet; use reshard_after_forward=True/False on a 1-D mesh")


class WeightGather(_Buffers, AllGather):
    def __init__(self, comm: Comm, cfg: Config, label: str,
                 version: Callable[[], tuple]) -> None:
        self.comm, self.cfg, self.label, self.version = comm, cfg, label, version
        self.p = cfg.hpz_partition_size if cfg.quantized_weights else 1
        self.secondary: Optional[torch.Tensor] = None  # this rank's column of wire pieces
        self.current_for: Optional[tuple] = None       # the weights' version it stands for

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> None:
        _check_group(self.comm, group, "an all-gather")
        self.comm.unit = self.label
        if not self.cfg.quantized_weights or output_tensor.dtype == torch.uint8:
            # zero3 (and mixed parameter dtypes, which FSDP2 gathers as bytes)
            self.comm.all_gather(output_tensor, input_tensor, op="all_gather/fsdp2").wait()
            return None
        w, c = self.comm.topo.world_size, input_tensor.numel()
        lay = ShardLayout.of(c * w, w, self.cfg)
        bits = self.cfg.weight_bits
        if self.p > 1 and self.secondary is not None and self.current_for == self.version():
            wire, pieces, slots = self._from_secondary(lay)
        else:
            x = torch.zeros(lay.shard_numel, dtype=torch.float32, device=input_tensor.device)
            x[:c] = input_tensor
            send = quantize(x, bits, lay.block).to_bytes()
            wire = torch.empty(w * send.numel(), dtype=torch.uint8, device=send.device)
            self.comm.all_gather(wire, send, op="all_gather/fsdp2",
                                 scale_bytes=w * (lay.shard_numel // lay.block) * 4).wait()
            pieces, slots = w, None
            if self.p > 1:  # hpZ: keep this rank's pieces k*P + i
                i = self.comm.topo.rank % self.p
                self.secondary = wire.view(-1, self.p, send.numel())[:, i].clone().view(-1)
                self.current_for = self.version()
        full = torch.empty(w * lay.shard_numel, dtype=output_tensor.dtype,
                           device=output_tensor.device)
        dequantize_pieces(wire, full, pieces=pieces, bits=bits, block=lay.block, slots=slots)
        output_tensor.view(w, c).copy_(full.view(w, -1)[:, :c])
        return None

    def _from_secondary(self, lay: ShardLayout) -> tuple[torch.Tensor, int, list[int]]:
        """The gather inside the hpZ group from the kept pieces: member i's piece k
        arrives at i*K + k and belongs in slot k*P + i."""
        g, k = self.p, self.comm.topo.world_size // self.p
        wire = torch.empty(g * self.secondary.numel(), dtype=torch.uint8,
                           device=self.secondary.device)
        self.comm.all_gather(wire, self.secondary, op="all_gather/fsdp2/hpz", group="hpz",
                             scale_bytes=g * k * (lay.shard_numel // lay.block) * 4).wait()
        return wire, g * k, [j * g + i for i in range(g) for j in range(k)]


class GradReduce(_Buffers, ReduceScatter):
    def __init__(self, comm: Comm, cfg: Config, label: str) -> None:
        self.comm, self.cfg, self.label = comm, cfg, label
        self.route: Optional[QgzReduce] = None  # made at the first call (its block)

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
            self.route = QgzReduce.from_config(self.cfg, block=lay.block, topo=self.comm.topo,
                                               name=self.label)
        g = torch.zeros(w, lay.shard_numel, dtype=torch.float32, device=input_tensor.device)
        g[:, :c] = input_tensor.view(w, c)
        mean = self.route.reduce(self.comm, g.view(-1))  # the sum / W
        output_tensor.copy_(mean[:c] * (scale * w))
        return None
