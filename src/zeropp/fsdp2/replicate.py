"""HSDP: the gradient mean across replicas, zeropp's instead of FSDP2's full-width
all-reduce.

On a (replicate, shard) mesh FSDP2 reduce-scatters each gradient inside the shard
group (inside the node, as HSDP is laid out), then all-reduces the result over the
replicate group, one rank per node: every gradient crosses the network at full width,
twice ((R-1)/R of it each way of a ring). `ReplicaMean` does that mean as qgZ's INT4
reduce-scatter over the replicas (the preset's error feedback; grads/qgz.py), then
gathers the reduced chunks as qwZ's INT8 blocks (weights/world.py): (0.5 + 1) / 8 of
the all-reduce's bytes, plus scales. Every replica, the chunk's owner too,
dequantizes the same bytes, so the replicas stay bitwise identical.

[Note: how FSDP2's replicate all-reduce is taken over]
FSDP2 (torch 2.13) has no custom-comm slot for it. It all-reduces over
`mesh_info.replicate_process_group` (FSDPParamGroup._all_reduce_process_group),
then calls the module's all-reduce hook (`set_all_reduce_hook`, public) on the
result. `take_over` points that attribute (in the group's own copy of its mesh info)
at a group of this rank alone, so FSDP2's all-reduce becomes a copy in place that
sends nothing, and installs `ReplicaMean` as the hook. The attribute is read nowhere
else after `fully_shard` (its init groups parameters by it, before). `check_internals`
verifies both facts from FSDP2's source at install and refuses, naming the torch
version, when they no longer hold; tests/fsdp2/test_fsdp2_nd.py calls it.

[Note: the user's all-reduce hook]
FSDP2 has one hook slot, which the mean now fills; a hook of the user's (torchtitan's
fault-tolerant HSDP sets one on every FSDP module) would replace it and silently
leave every replica with its own gradient. So the user's hook composes: one set
before `install` is kept, and `take_over` gives the module a `set_all_reduce_hook` of
its own that hands later ones to `ReplicaMean`, which calls the hook on the mean, as
FSDP2 calls it on its all-reduce's result. What FSDP2's setter refuses (a module
with several groups, a stream under HSDP) it still refuses. It sees what stock's sees,
the mean (the sum / the module's gradient divide factor, where set): under sum
reductions FSDP2 divides after the hook, so `ReplicaMean` divides before it instead,
and the group's factor is 1 (the module's `set_gradient_divide_factor` sets ours).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import weakref
from typing import Any, Callable, Optional

import torch

from ..collectives import Comm
from ..config import Config
from .comms import Buffers, Failures, attach
from .regions import Kinds


class ReplicaMean:
    """The hook FSDP2 calls on a module's gradient summed over its shard group: replaced
    in place by the sum over every rank divided by the module's gradient divide factor
    (`factor`; none: the number of ranks), as FSDP2 would divide it (the note). Each
    region of it (regions.py) travels on its own."""

    def __init__(self, comm: Comm, cfg: Config, label: str, shards: int,
                 kinds: Kinds, failures: Failures) -> None:
        self.comm, self.label, self.kinds, self.failures = comm, label, kinds, failures
        self.user_hook: Optional[Callable[[torch.Tensor], None]] = None  # (the note)
        self.shards, self.factor = shards, None  # (take_over sets the module's factor)
        # per region: qgZ, then qwZ's gather of the chunks (no secondary: nothing kept across steps)
        self.buffers = Buffers(comm, dataclasses.replace(
            cfg, quantized_weights=True, hpz_partition_size=1, hierarchical_gather=False,
            weight_delta=False), version=lambda: (), op="reduce_scatter/hsdp_grad")

    def __call__(self, grad: torch.Tensor) -> None:
        with self.failures.guard(f"the mean over replicas of module {self.label}"):
            self._mean(grad)
        if self.user_hook is not None:
            self.user_hook(grad)

    def _mean(self, grad: torch.Tensor) -> None:
        self.comm.unit = self.label
        r, n = self.comm.topo.world_size, grad.numel()
        partial, trained = self.kinds.partial(n), self.kinds.trained()
        for region in self.kinds.regions(n, grads=True):
            buf = self.buffers.of(region.kind, region.numel)
            lay = buf.layout
            g = region.take(grad.view(1, n), lay.padded_numel)
            # this replica's chunk of the sum / R
            mean = self.buffers.route(region.kind, lay.block, partial=partial,
                                      trained=trained).reduce(self.comm, g)
            full = torch.empty(lay.padded_numel, dtype=torch.float32, device=grad.device)
            buf.weights.finish(buf.weights.issue(self.comm, "hsdp_grad", mean, full))
            if self.factor is not None:
                full.mul_(r)  # the sum over the replicas: the factor covers them
            region.put(full.view(1, -1), grad.view(1, n))
        # FSDP2's division after a sum reduction, the same op on the same tensor
        grad.div_(self.shards if self.factor is None else self.factor)


def check_internals(param_group: Any) -> None:
    """The facts about FSDP2 that `take_over` relies on (the note), from its source."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as fc
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fpg
    from torch.distributed.fsdp import FSDPModule
    prop = getattr(type(param_group), "_all_reduce_process_group", None)
    try:
        reads = (isinstance(prop, property)
                 and "mesh_info.replicate_process_group" in inspect.getsource(prop.fget))
        uses = "self._all_reduce_process_group" in inspect.getsource(
            fpg.FSDPParamGroup.post_backward)
        # a sum reduction with factor 1 is divided by nothing, before or after (pre, post)
        once = (fc._get_gradient_divide_factors(None, None, torch.float32, "", 1.0, True)[:2]
                == (None, 1.0))
    except (AttributeError, OSError, TypeError):  # no source or function: nothing is verified
        reads = uses = once = False
    if not (reads and uses and once and hasattr(param_group.mesh_info, "replicate_process_group")
            and hasattr(FSDPModule, "set_force_sum_reduction_for_comms")):
        raise NotImplementedError(
            "zeropp.fsdp2: HSDP relies on how torch 2.13's FSDP2 picks its all-reduce group "
            f"and divides sums; torch {torch.__version__}'s differs: use a 1-D mesh with preset "
            "'zeropp-plus' (docs/fsdp2.md)")


def take_over(module: Any, param_group: Any, hook: ReplicaMean, solo: Any) -> None:
    """FSDP2's replicate all-reduce of `module` sends nothing; `hook` does the mean. Sum
    reductions only: FSDP2 would otherwise all-reduce with AVG on the one-rank group,
    which NCCL gets wrong at size 1 (torch itself avoids it there), and divides by the
    shard group's size after the hook, which means over the replicas itself. A hook the
    user set, or sets later, runs on the mean, divided as FSDP2 divides it (the note)."""
    check_internals(param_group)
    # the group's own copy: shard_placement_fn may hand one mesh info to every module,
    # whose later groups must still find their replicas in it
    param_group.mesh_info = copy.copy(param_group.mesh_info)
    param_group.mesh_info.replicate_process_group = solo
    module.set_force_sum_reduction_for_comms(True)
    hook.user_hook = param_group._all_reduce_hook
    hook.factor, param_group.gradient_divide_factor = param_group.gradient_divide_factor, 1.0
    attach(module, param_group, "_all_reduce_hook", hook, "set_all_reduce_hook")
    if "set_all_reduce_hook" in vars(module):  # once per module, whatever its groups
        return
    fsdp2_setter, ref = type(module).set_all_reduce_hook, weakref.ref(module)  # (no cycle)

    def set_all_reduce_hook(hook: Callable[[torch.Tensor], None], *, stream: Any = None
                            ) -> None:
        groups = ref()._get_fsdp_state()._fsdp_param_groups
        if len(groups) != 1:  # FSDP2 refuses: the hook would be ambiguous across groups
            return fsdp2_setter(ref(), hook, stream=stream)
        if stream is not None:  # as FSDP2 says, before it would have replaced the mean
            raise ValueError("stream cannot be set when using native HSDP")
        groups[0]._all_reduce_hook.user_hook = hook

    def set_gradient_divide_factor(factor: float) -> None:
        for group in ref()._get_fsdp_state()._fsdp_param_groups:
            if isinstance(group._all_reduce_hook, ReplicaMean):
                group._all_reduce_hook.factor = factor
            else:
                group.gradient_divide_factor = factor
    module.set_all_reduce_hook = set_all_reduce_hook
    module.set_gradient_divide_factor = set_gradient_divide_factor
