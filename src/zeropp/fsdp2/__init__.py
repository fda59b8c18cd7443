"""ZeRO++ under PyTorch FSDP2: zeropp's collectives in `fully_shard`'s custom-comm slots.

    fully_shard(block) for each block; fully_shard(model)   # the user's own FSDP2
    zeropp.fsdp2.install(model, "zeropp")                   # one line

`install` puts a `WeightGather` and a `GradReduce` (comms.py) on every FSDP module:
the codecs and routes of zeropp's own engine (quant.py, layout.py, grads/qgz.py, hpZ's
column layout), bytes counted in `zeropp.comm_stats(model)`. Any preset or Config:
"zero3" (FSDP2's own traffic, counted), "qwz", "hpz", "qgz", "zeropp", "zeropp-plus".
Any FSDP mesh: 1-D over the world, the dp dimension of tensor parallel x FSDP (a
topology per FSDP group: groups.py), HSDP (the mean across replicas: replicate.py),
an expert mesh beside the dp mesh in one module (a comm per FSDP parameter group:
comms.py). reshard_after_forward True, False or the group's ranks per node. Not yet:
other ints, CPU offload (each refused in one line).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from ..buffer import ShardedBuffer, held_params, make_comm, step_hooks, version_of
from ..collectives import Comm
from ..config import Config
from ..grads.pipeline import ReducePipeline
from ..stats import CommStats
from ..topology import Topology, get_topology, reduce_groups
from .comms import Buffers, Failures, GradReduce, Later, WeightGather, attach
from .groups import group_topology, solo_group
from .regions import Kinds
from .replicate import ReplicaMean, take_over


class Installed:
    """What `install` leaves on the model (`model._zeropp_fsdp2`): the Config, the byte
    accounting, each FSDP parameter group's comms and ShardedBuffers, and the optimizer
    steps seen (hpZ's secondaries go stale); it answers the step hooks for them all."""

    def __init__(self, cfg: Config, topo: Topology) -> None:
        self.cfg, self.topo, self.stats, self.steps = cfg, topo, CommStats(), 0
        self.comms: list[tuple[str, Buffers, GradReduce]] = []
        self.made: dict[Any, tuple[Comm, Config]] = {}  # a comm per group (its topology's ranks)
        self.failures = Failures(self.refresh)  # a failure drops every secondary (comms.py)
        self.later: Optional[Later] = None  # the world group's qgZ off backward (comms.py)

    @property
    def params(self) -> set[int]:
        """Ids of the sharded parameters now (`load_state_dict(assign=True)` replaces them)."""
        return {id(p) for _, _, reduce in self.comms for p in reduce.kinds.params}

    def buffers(self) -> list[ShardedBuffer]:
        return [b for _, buffers, _ in self.comms for b in buffers.values()]

    def before_step(self) -> None:
        if self.later is not None:  # (a backward drains them already)
            self.later.drain()
        for b in self.buffers():
            b.before_step()

    def after_step(self) -> None:
        self.steps += 1  # before the secondaries go stale: the versions read it
        for b in self.buffers():
            b.after_step()

    def refresh(self) -> None:
        """The next gather of every module is a full one (`zeropp.refresh`)."""
        for b in self.buffers():
            b.invalidate()

    def add_group(self, m: FSDPModule, group: Any, label: str) -> None:
        """zeropp's comms in the slots of `m`'s FSDP parameter group `group`."""
        cfg, topo, info = self.cfg, self.topo, group.mesh_info
        if not hasattr(info, "shard_process_group"):
            raise NotImplementedError(f"zeropp.fsdp2: module {label} is replicated only "
                                      "(replicate(), DDP); zeropp's comms need FSDP")
        if isinstance(group.offload_policy, CPUOffloadPolicy):
            raise NotImplementedError("zeropp.fsdp2: CPUOffloadPolicy is not supported")
        comm, gcfg = self.group_comm(info.shard_process_group)
        kinds = Kinds(group, label)
        buffers = Buffers(comm, gcfg, lambda: version_of(kinds.params, lambda: self.steps)())
        gather = WeightGather(comm, gcfg, label, buffers, kinds, self.failures)
        world = comm is self.made.get("world", (None,))[0]  # the engine's: its pipeline's too
        if world and self.later is None and cfg.quantized_gradients and cfg.async_reduce:
            self.later = Later(ReducePipeline(Comm(
                topo, self.stats, timeout=cfg.collective_timeout, groups=reduce_groups(topo)),
                depth=cfg.reduce_buckets, asynchronous=True), self.failures)
        reduce = GradReduce(comm, gcfg, label, buffers, kinds, self.failures,
                            self.later if world else None, group)
        if getattr(info, "replicate_mesh_dim", None) is not None:
            rcomm, _ = self.group_comm(info.replicate_process_group, replicas=True)
            # replicas inside a node, or no qgZ: FSDP2's own all-reduce, counted
            reduce.replicas = rcomm
            if cfg.quantized_gradients and rcomm.topo.num_nodes > 1:
                reduce.replica = ReplicaMean(rcomm, cfg, label, info.shard_process_group.size(),
                                            kinds, self.failures)
                take_over(m, group, reduce.replica, solo_group())
        self.comms.append((label, buffers, reduce))
        attach(m, group, "_all_gather_comm", gather, "set_custom_all_gather")
        attach(m, group, "_reduce_scatter_comm", reduce, "set_custom_reduce_scatter")

    def group_comm(self, pg: dist.ProcessGroup, replicas: bool = False) -> tuple[Comm, Config]:
        """The comm over an FSDP shard group, and the Config its routes run with. The
        world in rank order is the engine's own topology; any other group (the dp mesh
        of TP x FSDP, an expert mesh) gets its own (groups.py), where hpZ is the group's
        ranks per node: none when it has one rank per node."""
        cfg, topo = self.cfg, self.topo
        world = dist.get_process_group_ranks(pg) == list(range(topo.world_size))  # every rank
        sub = topo if world else group_topology(pg, topo.node_size)  # collective: everywhere
        key = "world" if world else (replicas, sub.members)
        if key in self.made:
            return self.made[key]
        if world:
            gcfg = cfg
        elif sub.num_nodes == 1:  # nothing crosses nodes: ZeRO-3's exact collectives
            gcfg = Config(node_size=sub.node_size, param_dtype=cfg.param_dtype,
                          reduce_dtype=cfg.reduce_dtype, collective_timeout=cfg.collective_timeout)
        else:
            hpz = sub.node_size if cfg.hpz_partition_size > 1 else 1
            if cfg.hpz_partition_size > 1 and hpz == 1 and not replicas and dist.get_rank() == 0:
                warnings.warn(f"zeropp.fsdp2: the FSDP group of ranks {list(sub.members)} has "
                              "one rank per node (e.g. tensor parallel inside the node): its "
                              "gathers and reductions all cross nodes, qwZ and qgZ run, hpZ "
                              "cannot (no rank of the group shares a node to gather from)",
                              stacklevel=3)
            gcfg = dataclasses.replace(cfg, hpz_partition_size=hpz,
                                       weight_delta=cfg.weight_delta and hpz > 1)
        self.made[key] = make_comm(gcfg, sub, self.stats), gcfg
        return self.made[key]


def install(model: nn.Module, preset: Union[str, Config] = "zeropp", *,
            node_size: Optional[int] = None) -> nn.Module:
    """Put zeropp's comms on every FSDP module of `model` (after the user's
    `fully_shard` calls; every rank). Returns the model."""
    if hasattr(model, "_zeropp_fsdp2"):
        raise RuntimeError("zeropp.fsdp2.install: already installed on this model")
    cfg = preset if isinstance(preset, Config) else Config.preset(preset, node_size=node_size)
    inst = Installed(cfg, get_topology(cfg.node_size))
    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("zeropp.fsdp2.install: no FSDP module in this model; call "
                         "fully_shard on its blocks and on the root first")
    for name, m in modules:
        # several groups: per-parameter meshes, as torchtitan shards MoE experts (comms.py)
        for i, group in enumerate(m._get_fsdp_state()._fsdp_param_groups):
            inst.add_group(m, group, (name or "<root>") + (f"#{i}" if i else ""))
    step_hooks(model, inst.stats,  # removed when the model dies
               lambda opt: [inst] if held_params(opt) & inst.params else [])
    model._zeropp_fsdp2 = inst
    return model


def comm_state(model: nn.Module) -> dict[str, dict[str, Any]]:
    """This rank's comm state an exact resume needs, per FSDP module: qWD's copies (and
    whether a delta is due), qgZ's error-feedback residuals (HSDP: those of the hop
    across replicas too), per region (regions.py). Different on every rank: save
    it per rank beside the model and optimizer's DCP checkpoint (`save_comm_state`)."""
    out = {}
    for label, buffers, reduce in _installed(model).comms:
        out[label] = {"buffers": buffers.state()}
        if reduce.replica is not None:  # HSDP: the replicas' hop residuals
            out[label]["replica"] = reduce.replica.buffers.state()
    return out


def _file(directory: Union[str, os.PathLike], rank: int) -> Path:
    return Path(directory) / f"zeropp_rank{rank}.pt"


def save_comm_state(model: nn.Module, directory: Union[str, os.PathLike]) -> None:
    """`comm_state(model)` into this rank's file in `directory` (e.g. the DCP
    checkpoint's own directory); every rank."""
    path = _file(directory, dist.get_rank())
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(comm_state(model), path)


def load_comm_state(model: nn.Module,
                    state: Union[dict[str, dict[str, Any]], str, os.PathLike]) -> None:
    """Restore `comm_state` (a dict, or the directory `save_comm_state` wrote) after
    the model's sharded weights were loaded (DCP): the copies stand for the weights
    as they are at this call."""
    if not isinstance(state, dict):
        state = torch.load(_file(state, dist.get_rank()), weights_only=True)
    device, comms = next(model.parameters()).device, _installed(model).comms
    mine = [label for label, _, _ in comms]
    if set(mine) != set(state) or not all("buffers" in s for s in state.values()):
        raise ValueError(f"zeropp.fsdp2.load_comm_state: not the comm_state of this model's "
                         f"FSDP modules {mine} (it holds {sorted(state)[:8]})")
    for label, buffers, reduce in comms:
        saved = state[label]
        buffers.load_state(saved["buffers"], device)
        if reduce.replica is not None:
            reduce.replica.buffers.load_state(saved.get("replica", {}), device)


def _installed(model: nn.Module) -> Installed:
    inst = getattr(model, "_zeropp_fsdp2", None)
    if inst is None:
        raise ValueError("zeropp.fsdp2: zeropp.fsdp2.install was not called on this model")
    return inst
