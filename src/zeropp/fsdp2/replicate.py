"""HSDP: the gradient mean across replicas, zeropp's instead of FSDP2's full-width
all-reduce.

On a (replicate, shard) mesh FSDP2 reduce-scatters each gradient inside the shard
group (inside the node, as HSDP is laid out), then all-reduces the result over
the replicate group, one rank per node: every gradient crosses the network at
full width, twice ((R-1)/R of it each way of a ring). `ReplicaMean` does that
mean as qgZ's quantized reduce-scatter over the replicas (INT4, with the
preset's error feedback; grads/qgz.py, the route the engine runs) and then
gathers the reduced chunks as qwZ gathers weights (INT8 blocks; weights/world.py):
(0.5 + 1) / 8 of the all-reduce's bytes, plus scales. Every replica, the owner of
a chunk too, dequantizes the same bytes, so the replicas stay bitwise identical.

[Note: how FSDP2's replicate all-reduce is taken over]
FSDP2 (torch 2.13) has no custom-comm slot for it. It all-reduces over
`mesh_info.replicate_process_group` (FSDPParamGroup._all_reduce_process_group)
and then calls the module's all-reduce hook (`set_all_reduce_hook`, public) on
the result. `take_over` points that attribute at a group of this rank alone, so
FSDP2's all-reduce becomes a copy in place that sends nothing, and installs
`ReplicaMean` as the hook. The attribute is read nowhere else after
`fully_shard` (its init groups parameters by it, before). `check_internals`
verifies both facts from FSDP2's source at install and refuses, naming the torch
version, when they no longer hold; tests/fsdp2/test_fsdp2_nd.py calls it. A hook the
user sets later with `set_all_reduce_hook` replaces the mean: do not.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Optional

import torch

from ..collectives import Comm
from ..config import Config
from ..grads.qgz import QgzReduce
from ..layout import ShardLayout
from ..weights import WeightSpec, world
from .comms import attach


class ReplicaMean:
    """The hook FSDP2 calls on a module's reduce-scattered gradient (fp32): replaced
    in place by its mean over the replicas, or by the sum when the module has a
    gradient divide factor (FSDP2 then divides by that factor alone)."""

    def __init__(self, comm: Comm, cfg: Config, label: str, param_group: Any) -> None:
        self.comm, self.cfg, self.label = comm, cfg, label
        # weakly: the param group holds the model, which the step hooks must not keep alive
        self.param_group = weakref.ref(param_group)
        self.route: Optional[QgzReduce] = None  # made at the first call (its block)

    def make_route(self, block: int) -> None:
        self.route = QgzReduce.from_config(self.cfg, block=block)
        self.route.op = "reduce_scatter/hsdp_grad"

    def __call__(self, grad: torch.Tensor) -> None:
        self.comm.unit = self.label
        r, n = self.comm.topo.world_size, grad.numel()
        lay = ShardLayout.of(n, r, self.cfg)
        if self.route is None:
            self.make_route(lay.block)
        g = torch.zeros(lay.padded_numel, dtype=torch.float32, device=grad.device)
        g[:n] = grad.reshape(-1)
        mean = self.route.reduce(self.comm, g)  # this replica's chunk of the sum / R
        spec = WeightSpec.of(lay, self.cfg.weight_bits)
        full = torch.empty(lay.padded_numel, dtype=torch.float32, device=grad.device)
        pending, out = world.issue(spec, self.comm, "all_gather/hsdp_grad", mean, full)
        pending.wait()
        world.finish(spec, out, full)
        group = self.param_group()
        if group is not None and group.gradient_divide_factor is not None:
            full.mul_(r)  # FSDP2 sums over replicas then: its factor covers them
        grad.copy_(full[:n].view_as(grad))


def check_internals(param_group: Any) -> None:
    """The facts about FSDP2 that `take_over` relies on (the note), from its source."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fpg
    from torch.distributed.fsdp import FSDPModule
    prop = getattr(type(param_group), "_all_reduce_process_group", None)
    try:
        reads = (isinstance(prop, property)
                 and "mesh_info.replicate_process_group" in inspect.getsource(prop.fget))
        uses = "self._all_reduce_process_group" in inspect.getsource(
            fpg.FSDPParamGroup.post_backward)
    except (OSError, TypeError):  # no source to read: nothing is verified
        reads = uses = False
    if not (reads and uses and hasattr(param_group.mesh_info, "replicate_process_group")
            and hasattr(FSDPModule, "set_force_sum_reduction_for_comms")):
        raise NotImplementedError(
            f"zeropp.fsdp2: HSDP relies on FSDP2 all-reducing over "
            f"mesh_info.replicate_process_group, as torch 2.13 does; torch {torch.__version__} "
            "does not: use a 1-D mesh with preset 'zeropp-plus' (docs/fsdp2.md)")


def take_over(module: Any, param_group: Any, hook: ReplicaMean, solo: Any) -> None:
    """FSDP2's replicate all-reduce of `module` sends nothing; `hook` does the mean. Sum
    reductions only: FSDP2 would otherwise all-reduce with AVG on the one-rank group,
    which NCCL gets wrong at size 1 (torch itself avoids it there), and divides by the
    shard group's size after the hook, which means over the replicas itself."""
    check_internals(param_group)
    param_group.mesh_info.replicate_process_group = solo
    module.set_force_sum_reduction_for_comms(True)
    attach(module, param_group, "_all_reduce_hook", hook, "set_all_reduce_hook")
