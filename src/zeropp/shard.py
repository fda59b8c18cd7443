"""shard(model, cfg): ZeRO-3 in place, by hooks on the model's units.

A *unit* is a module whose parameters are gathered and freed together: by default each entry of
every `nn.ModuleList` (a transformer's blocks), plus the root for the rest (units.py). `shard()`
flattens each unit's parameters into flat buffers (flat_param.py) and hooks the unit
(unit_hooks.py); `ShardState` is the model's side: unit order, prefetch, the step's phase, the end
of backward, the optimizer-step hooks. Model class and training loop stay plain PyTorch.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from .buffer import ShardedBuffer, held_params, make_comm, step_hooks
from .collectives import Comm
from .config import Config
from .deferred import defer_meta, paused, show_module
from .flat_param import FlatParam
from .grads.pipeline import ReducePipeline
from .guards import check_same_model, forget_parameters, one_line
from .host_memory import mmap_threshold_for, release_freed_host_memory
from .meter import GatherMeter
from .quant import release_scratch
from .state_dict import install as install_state_dict_hooks
from .stats import CommStats
from .topology import Topology, get_topology, reduce_groups
from .unit_hooks import Unit
from .units import assign_params, unit_modules


class ShardState:
    """Per-model bookkeeping: the units, their order, and the phase of the step."""

    def __init__(self, cfg: Config, topo: Topology) -> None:
        self.cfg, self.topo = cfg, topo
        self.stats = CommStats()
        self.meter = GatherMeter()  # full weights alive now and at peak (memory_stats)
        self.comm = make_comm(cfg, topo, self.stats)
        self.reducer = ReducePipeline(
            Comm(topo, self.stats, timeout=cfg.collective_timeout, groups=reduce_groups(topo)),
            depth=cfg.reduce_buckets, asynchronous=cfg.async_reduce)
        self.units: list[Unit] = []
        self.forward_order: list[Unit] = []
        self.last_forward_order: list[Unit] = []
        self.finished_order: list[Unit] = []   # by post-forward: inner units first
        self.backward_order: list[Unit] = []
        self.backward_active = False
        self.gathered_depth = 0  # open zeropp.gathered() contexts
        self.snapshots: list[dict] = []  # the open writable ones' (gathered.py)
        self.held: Any = None  # coalesce.HeldGradients inside coalesced_reduction()
        self.optimizer_steps = 0  # steps over these shards; kept in checkpoints

    def __reduce_ex__(self, protocol: int) -> Any:  # (its process groups, threads and hooks)
        raise one_line(TypeError("zeropp: a sharded model cannot be copied or pickled (deepcopy, "
                                 "AveragedModel, torch.save(model)): copy it before zeropp.shard()"
                                 ", then shard both; save zeropp.full_state_dict(model) instead"))

    @property
    def root(self) -> nn.Module:
        """The sharded model."""
        return self.root_ref()

    @property
    def flats(self) -> list[FlatParam]:
        return [f for u in self.units for f in u.flats]

    # ---- forward -----------------------------------------------------------------
    def begin_iteration(self) -> None:
        """A root forward outside backward: what an interrupted forward or backward (an exception
        the loop caught) left is freed; every unit is gathered afresh from the current weights."""
        if self.forward_order:
            self.last_forward_order = self.forward_order
        self.forward_order, self.finished_order = [], []
        self.backward_active = False
        for u in self.units:
            u.free()
            for f in u.flats:  # a gradient an aborted backward left behind
                f.grads.drop()
                if f.stale:  # persistent, and its master shard was written since
                    f.free(let_go=True, force=True)
        self.reducer.drain(keep=False)  # an interrupted backward's: dropped (a failure raised once)

    def regather_resident(self, flats: list[FlatParam]) -> None:
        """Regather those of `flats` kept resident (persistent, or pinned by a gathered()) from the
        master shards: all issued, then all waited; old weights let go (tensors taken keep them)."""
        flats = [f for f in flats if f.persistent or f.unit.pins]
        for f in flats:
            f.free(let_go=True, force=True)
        for f in flats:
            self.comm.unit = f.unit.label
            f.issue_gather(self.comm, phase="persistent")
        for f in flats:
            f.wait_gather()

    def prefetch_forward(self) -> None:
        """Prefetch the next `prefetch_depth` units of the last forward (in flight: skipped)."""
        if not self.cfg.prefetch:
            return
        k = len(self.forward_order)
        for nxt in self.last_forward_order[k:k + self.cfg.prefetch_depth]:
            nxt.issue_gather(prefetch=True)

    def end_forward(self) -> None:
        for u in self.units:  # e.g. a prefetch that the model did not use this time
            u.free()
        # Backward reaches a unit when its output's gradient is ready: the reverse of the order
        # in which forwards finished (the root, around all others, first).
        self.backward_order = list(reversed(self.finished_order))
        self.last_forward_order = self.forward_order
        release_scratch()  # qWD's delta temporaries: reused within the forward only

    # ---- backward ----------------------------------------------------------------
    def begin_backward(self) -> None:
        if self.backward_active:
            return
        if self.gathered_depth:
            raise RuntimeError("zeropp: backward inside zeropp.gathered() is not supported (the "
                               "resident weights would go stale at the next optimizer step); "
                               "leave the context, then run the training forward and backward")
        self.backward_active = True
        for u in self.units:
            u.backward_gathered = False
        Variable._execution_engine.queue_callback(self.end_backward)

    def prefetch_backward(self, unit: Unit) -> None:
        order = self.backward_order
        if not self.cfg.prefetch or unit not in order:
            return
        ahead = [u for u in order[order.index(unit) + 1:]
                 if not u.backward_gathered and u.backward_reads_weights]
        for nxt in ahead[:self.cfg.prefetch_depth]:
            nxt.issue_gather(prefetch=True)

    def end_backward(self) -> None:
        # A unit whose gradient never arrived (not on the loss's path) keeps .grad None, as in plain
        # PyTorch. Ranks must agree on which (as in FSDP): collectives follow backward order.
        try:
            # Units with parameters unused this step: reduced now, in unit order on every rank
            # (flat_grad.py's note).
            for u in self.units:
                for f in u.flats:
                    if f.trainable and f.grads.end_backward():
                        u.reduce(f)
            self.reducer.drain()  # gradients are complete when backward returns
            release_scratch()  # qgZ's temporaries: reused within the backward only
        finally:
            for u in self.units:
                u.free()
                for f in u.flats:
                    f.grads.needs_reduce = False
                    f.settle()
            self.backward_active = False


def _step_hooks(state: ShardState) -> None:
    """Around any optimizer step over this model's master shards (buffer.py): before, complete the
    reductions; after, count the step and gather again the persistent flats it updated."""
    def select(opt: torch.optim.Optimizer) -> list[ShardedBuffer]:
        st, held = state_ref(), held_params(opt)
        mine = [] if st is None else [f.buffer for f in st.flats if id(f.primary_shard) in held]
        if mine and isinstance(opt, (torch.optim.LBFGS, getattr(torch.optim, "Adafactor", ()))):
            raise TypeError(f"zeropp: {type(opt).__name__} reads whole parameters (Adafactor's "
                            "factored moments and RMS, LBFGS's dot products), not elements: on "
                            "flat master shards it would silently compute other numbers; use an "
                            "elementwise optimizer (AdamW, SGD, Adagrad, ...)")
        return mine

    def before(buffers: list[ShardedBuffer]) -> None:
        st = state_ref()
        if st.gathered_depth:
            raise RuntimeError("zeropp: optimizer.step() inside zeropp.gathered(): the "
                               "gathered weights would go stale; step after the context")
        st.reducer.drain()  # no-op after a backward: it drained already

    def after(buffers: list[ShardedBuffer]) -> None:
        st = state_ref()
        st.optimizer_steps += 1
        mine = {id(b) for b in buffers}
        st.regather_resident([f for f in st.flats if id(f.buffer) in mine])
    state_ref = weakref.ref(state)
    step_hooks(state, state.stats, select, before, after)


def shard(model: nn.Module, cfg: Optional[Config] = None, *, unit_types: Optional[tuple] = None,
          param_groups: Optional[list] = None, sync_module_states: bool = False) -> nn.Module:
    """Shard `model` in place (ZeRO-3) and return it.

    `unit_types`: module classes whose instances become units; default: the
    entries of every `nn.ModuleList`. The root is always a unit.
    `param_groups`: lists of the model's parameters (or torch's group dicts) that an optimizer
    will treat differently (no weight decay); a unit's parameters of different groups go to
    different flat buffers, and `FlatParam.param_group` says which (the index; in none: -1).
    `sync_module_states`: every rank starts from rank 0's weights and buffers (broadcast one
    unit at a time, as FSDP's flag of that name does).
    A model built under `zeropp.deferred_init()` (or on the meta device: deferred.defer_meta) is
    materialized here one unit at a time: no rank ever holds more than one unit's full weights.
    """
    with paused():  # called inside an open deferred_init() / zero.Init(): nothing recorded
        cfg = cfg if cfg is not None else Config()
        if not isinstance(cfg, Config):
            raise TypeError(f"zeropp.shard: cfg must be a zeropp.Config, got {type(cfg).__name__}")
        if any(hasattr(m, "_zeropp_state") or hasattr(m, "_zeropp_unit") for m in model.modules()):
            raise RuntimeError("zeropp.shard: this model (or a submodule of it) is already "
                               "sharded; call shard() once, on the root model")
        show_module(model)  # parameters that show 0 elements until sharded (zero.Init's)
        if unit_types is not None and not isinstance(unit_types, tuple):
            unit_types = tuple(unit_types) if isinstance(unit_types, list) else (unit_types,)
        topo = get_topology(cfg.node_size)
        if any(p.device.type in ("cpu", "meta") for p in model.parameters()):  # meta: built on CPU
            threshold = mmap_threshold_for(sum(p.numel() for p in model.parameters()))
            if threshold is not None:  # freed buffers go back to the OS (memory.py)
                release_freed_host_memory(threshold)
        state = ShardState(cfg, topo)
        if any(p.is_meta for p in model.parameters()):
            defer_meta(model)  # then materialized one unit at a time, as deferred_init's
        units = unit_modules(model, unit_types)
        check_same_model(model, list(units.values()))  # one small all-gather; raises on all ranks
        sync = None
        if sync_module_states and topo.world_size > 1:
            sync = functools.partial(dist.broadcast, src=0)
            for b in model.buffers():
                sync(b.data)  # (.data: no autograd)
        owned = assign_params(model, units)
        group_of = {id(p): k for k, ps in enumerate(param_groups or [])
                    for p in (ps["params"] if isinstance(ps, dict) else ps)}
        regs = [r for plist in owned.values() for _, rs, _ in plist for r in rs]
        order = {m: list(m._parameters) for m, _ in regs}  # for the state dict's key order
        persistent = _persistent(model, cfg)
        if hooked := [fqns[0] for plist in owned.values() for p, _, fqns in plist
                      if p._backward_hooks or p._post_accumulate_grad_hooks]:
            raise ValueError(f"zeropp.shard: {hooked[0]} has a gradient hook, which shard() "
                             "would drop: hook the module's attribute after shard() instead")
        for m, attr in regs:
            del m._parameters[attr]
        forget_parameters([p for plist in owned.values() for p, _, _ in plist])
        for mod, name in units.items():
            groups: dict[tuple, list] = {}
            for entry in owned[mod]:
                p = entry[0]
                groups.setdefault((p.requires_grad, cfg.param_dtype or p.dtype,
                                   group_of.get(id(p), -1), id(p) in persistent), []).append(entry)
            prefix = f"{name}." if name else ""
            flats = [FlatParam(plist, topo=topo, cfg=cfg, compute_dtype=dtype, trainable=trainable,
                               name=f"{prefix}_zeropp_flat{k}", param_group=group, sync=sync,
                               persistent=keep)
                     for k, ((trainable, dtype, group, keep), plist) in enumerate(groups.items())]
            for k, f in enumerate(flats):
                mod.register_parameter(f"_zeropp_flat{k}", f.primary_shard)
            mod._zeropp_unit = unit = Unit(name, mod, flats, state)
            mod.__reduce_ex__ = state.__reduce_ex__  # pickle meets it before the hooks
            # Under torch.compile(model) the hooks (collectives, storage resizes) run
            # eagerly, each a graph break at the unit's boundary; the units' compute compiles.
            # Gathers before the pre-hooks the model brought (weight_norm's read the weights).
            mod.register_forward_pre_hook(_eager(unit.pre_forward), with_kwargs=True, prepend=True)
            mod.register_forward_hook(_eager(unit.post_forward))
            state.units.append(unit)
        install_state_dict_hooks(state.units, order)
        model._zeropp_state = state
        state.root_ref = weakref.ref(model)
        _step_hooks(state)
        if (hooks := getattr(model, "_zeropp_tensor_hooks", None)) is not None:  # a front door's
            for f in state.flats:
                f.set_hooks(hooks)
        return model


def _eager(hook: Callable) -> Callable:
    reason = ("zeropp: a unit's gather and free run outside the graph, so fullgraph=True "
              "cannot hold; compile without it, or compile each block")
    try:
        return torch.compiler.disable(hook, reason=reason)
    except TypeError:  # torch < 2.8 has no reason=
        return torch.compiler.disable(hook)


def _persistent(model: nn.Module, cfg: Config) -> set[int]:
    """Ids of the parameters kept gathered between steps (DeepSpeed's rule): each of at most
    `persistence_threshold` elements, in model order up to `model_persistence_threshold` in all."""
    cap, total, chosen = cfg.model_persistence_threshold, 0, set()
    for p in model.parameters():
        n = p.numel()
        if 0 < n <= cfg.persistence_threshold and (cap is None or total + n <= cap):
            chosen.add(id(p))
            total += n
    return chosen


def get_state(model: nn.Module) -> ShardState:
    if (st := getattr(model, "_zeropp_state", None)) is None:
        raise ValueError("zeropp: this model was not sharded with zeropp.shard()")
    return st


def _stats(model: nn.Module) -> CommStats:
    if (fsdp2 := getattr(model, "_zeropp_fsdp2", None)) is not None:  # zeropp.fsdp2.install
        return fsdp2.stats
    if not isinstance(model, nn.Module) and (ft := getattr(model, "_zeropp", None)) is not None:
        return ft.stats  # a process group from zeropp.ft.wrap
    return get_state(model).stats


def comm_stats(model: nn.Module) -> dict:
    """Bytes this rank sent since the last reset (see stats.CommStats), for a sharded
    or installed model, or a process group from `zeropp.ft.wrap` (its "steps": quorums)."""
    return _stats(model).as_dict()


def refresh(model: nn.Module) -> None:
    """Make the next gather of every unit a full one from the master shards.

    Needed only after writing master shards in a way version counters cannot see (through
    `.data`, or a fused in-place op outside the optimizer): hpZ secondaries (and qWD's copies)
    would otherwise keep the old weights (qWD: until deltas caught up). Optimizer steps,
    checkpoint loads, `load_state_dict` and in-place ops on the parameters are detected
    without it. Call it on every rank. Also for a model under `zeropp.fsdp2.install`, where
    the tensors of `model.state_dict()` are aliases with counters of their own: a write into
    them (`dcp.load` in place, without `load_state_dict` / `set_state_dict` after) needs it."""
    if (fsdp2 := getattr(model, "_zeropp_fsdp2", None)) is not None:
        return fsdp2.refresh()
    st = get_state(model)
    for f in st.flats:
        f.buffer.invalidate()
    st.regather_resident([f for f in st.flats if f.gathered])


def reset_comm_stats(model: nn.Module) -> None:
    _stats(model).reset()
