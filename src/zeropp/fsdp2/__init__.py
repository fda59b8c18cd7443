"""ZeRO++ under PyTorch FSDP2: zeropp's collectives in `fully_shard`'s custom-comm slots.

    fully_shard(block) for each block; fully_shard(model)   # the user's own FSDP2
    zeropp.fsdp2.install(model, "zeropp")                   # one line

`install` puts a `WeightGather` and a `GradReduce` (comms.py) on every FSDP
module: the same codecs and routes as zeropp's own engine (quant.py,
layout.py, grads/qgz.py, hpZ's column layout), with the bytes counted in
`zeropp.comm_stats(model)`. Any preset or Config: "zero3" (FSDP2's own
traffic, counted), "qwz", "hpz", "qgz", "zeropp", "zeropp-plus".
reshard_after_forward True, False or the node size. Not yet: other ints, HSDP
meshes, CPU offload (each refused in one line).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ..collectives import Comm
from ..config import Config
from ..stats import CommStats
from ..topology import get_topology
from .comms import GradReduce, WeightGather


class Installed:
    """What `install` leaves on the model (`model._zeropp_fsdp2`): the Config, the
    byte accounting, and the optimizer steps seen (hpZ's secondaries go stale)."""

    def __init__(self, cfg: Config, stats: CommStats) -> None:
        self.cfg, self.stats, self.steps = cfg, stats, 0
        self.params: set[int] = set()
        self.comms: list[tuple[str, WeightGather, GradReduce]] = []
        self._hooks: Any = None


def install(model: nn.Module, preset: Union[str, Config] = "zeropp", *,
            node_size: Optional[int] = None) -> nn.Module:
    """Put zeropp's comms on every FSDP module of `model` (after the user's
    `fully_shard` calls; every rank). Returns the model."""
    if hasattr(model, "_zeropp_fsdp2"):
        raise RuntimeError("zeropp.fsdp2.install: already installed on this model")
    cfg = preset if isinstance(preset, Config) else Config.preset(preset, node_size=node_size)
    topo = get_topology(cfg.node_size)
    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("zeropp.fsdp2.install: no FSDP module in this model; call "
                         "fully_shard on its blocks and on the root first")
    inst = Installed(cfg, CommStats())
    hpz = cfg.hpz_partition_size
    if topo.world_size % hpz:
        raise ValueError(f"zeropp.fsdp2: hpz_partition_size={hpz} must divide the world size "
                         f"{topo.world_size}")
    comm = Comm(topo, inst.stats, hpz, cfg.collective_timeout)
    for name, m in modules:
        groups = m._get_fsdp_state()._fsdp_param_groups
        if not groups:
            continue  # a module with no parameters of its own
        if len(groups) > 1:
            raise ValueError(f"zeropp.fsdp2: module {name or '<root>'} has several FSDP "
                             "parameter groups (shard_placement_fn meshes); one is supported")
        group = groups[0]
        if getattr(group.mesh_info, "replicate_mesh_dim", None) is not None:
            raise NotImplementedError(
                f"zeropp.fsdp2: module {name or '<root>'} is on a 2-D (HSDP) mesh; FSDP2's "
                "replicate all-reduce is its own. Use a 1-D mesh with preset 'zeropp-plus' "
                "(docs/fsdp2.md, HSDP users)")
        if isinstance(group.offload_policy, CPUOffloadPolicy):
            raise NotImplementedError("zeropp.fsdp2: CPUOffloadPolicy is not supported")
        sharded = [fp.sharded_param for fp in group.fsdp_params]
        inst.params |= {id(p) for p in sharded}
        label = name or "<root>"
        gather = WeightGather(comm, cfg, label, _version(inst, sharded))
        reduce = GradReduce(comm, cfg, label)
        inst.comms.append((label, gather, reduce))
        m.set_custom_all_gather(gather)
        m.set_custom_reduce_scatter(reduce)

    paths = [g.path for _, g, _ in inst.comms if g.path is not None]
    seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def ours(opt: Any) -> bool:  # (global hooks: every optimizer's steps come here)
        if opt not in seen:
            seen[opt] = any(id(p) in inst.params for g in opt.param_groups for p in g["params"])
        return seen[opt]

    def before_step(opt: Any, args: Any, kwargs: Any) -> None:
        if ours(opt):  # a secondary made stale by anything but a step refreshes in full
            for path in paths:
                path.before_step()

    def after_step(opt: Any, args: Any, kwargs: Any) -> None:
        if ours(opt):  # hpZ's secondaries go stale; qWD's are refreshed by a delta
            inst.steps += 1
            for path in paths:
                path.after_step()
    inst._hooks = (register_optimizer_step_pre_hook(before_step),
                   register_optimizer_step_post_hook(after_step))
    model._zeropp_fsdp2 = inst
    return model


def _version(inst: Installed, sharded: list) -> Any:
    """What a module's weights are now: the optimizer steps seen and each sharded
    tensor's version counter and storage (in-place writes, loads, replacement)."""
    locals_ = [getattr(p, "_local_tensor", p) for p in sharded]

    def version() -> tuple:
        return (inst.steps, *((t._version, t.data_ptr()) for t in locals_))
    return version


def comm_state(model: nn.Module) -> dict[str, dict[str, Any]]:
    """This rank's comm state an exact resume needs, per FSDP module: qWD's
    copies (and whether a delta is due), qgZ's error-feedback residuals and
    rounding generators. Different on every rank: save it per rank (e.g.
    `torch.save(comm_state(model), f"{dir}/zeropp_rank{rank}.pt")`) beside the
    model and optimizer's DCP checkpoint."""
    out = {}
    for label, gather, reduce in _installed(model).comms:
        s: dict[str, Any] = {}
        if gather.path is not None and gather.chunk.layout is not None:
            s.update({f"weights/{k}": v for k, v in gather.path.state().items()})
            s["numel"] = gather.chunk.layout.numel
        if reduce.route is not None:
            s.update({f"grad/{k}": v for k, v in reduce.route.codec.state().items()})
            s["grad_block"] = reduce.route.block
        out[label] = s
    return out


def load_comm_state(model: nn.Module, state: dict[str, dict[str, Any]]) -> None:
    """Restore `comm_state` after the model's sharded weights were loaded (DCP):
    the copies stand for the weights as they are at this call."""
    device = next(model.parameters()).device
    for label, gather, reduce in _installed(model).comms:
        s = state.get(label, {})
        if gather.path is not None and "numel" in s:
            gather.chunk.set_numel(int(s["numel"]))
            gather.chunk.full = torch.empty(0, device=device)  # (its device)
            gather.path.load_state({k[len("weights/"):]: v for k, v in s.items()
                                    if k.startswith("weights/")})
            gather.chunk.full = None
        if "grad_block" in s:
            reduce.make_route(int(s["grad_block"]))
            reduce.route.codec.load_state({k[len("grad/"):]: v for k, v in s.items()
                                           if k.startswith("grad/")}, device)


def _installed(model: nn.Module) -> Installed:
    inst = getattr(model, "_zeropp_fsdp2", None)
    if inst is None:
        raise ValueError("zeropp.fsdp2: zeropp.fsdp2.install was not called on this model")
    return inst
