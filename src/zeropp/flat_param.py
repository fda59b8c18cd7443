"""FlatParam: one unit's parameters flattened into one buffer and cut into W shards.

A unit's parameters of one kind (trainable or frozen, one compute dtype) are
concatenated in a fixed order, zero-padded to a multiple of W, and cut into W
equal *primary shards*. Rank r keeps shard r in fp32 as an `nn.Parameter`: the
master weights the optimizer updates. The full weights exist only between a
gather and the matching free.

[Note: zeropp's tensors]
  primary shard   rank r's 1/W of a flat buffer, fp32 (frozen: maybe INT8 wire
                  bytes): the master weights, an nn.Parameter the optimizer steps
  full weights    `full`: the whole flat buffer at the compute dtype, alive
                  between a gather and the matching free
  module attributes  `params`: one tensor per original parameter on `full`'s
                  storage (0 elements while freed); what the model computes with
  secondary shard hpZ: W/P primary shards of the ranks in this rank's column,
                  kept after a forward so the backward gathers inside the node
                  (weights/hpz.py, "the secondary shard's layout")
  qWD copy        a secondary kept across steps as qwZ's INT8 blocks, moved by
                  code deltas
  wire bytes      a quantized tensor as it travels: fp32 scales, then codes
                  (quant.py, "wire format")
  flat gradient   `grad`: a backward's full gradient of the buffer, assembled
                  from the per-parameter ones, handed to the reduce pipeline

[Note: how the full weights reach the module and come back in backward]
`full` is one flat buffer whose storage is allocated for a gather and resized
to zero bytes to free it; the same storage object lives on, so tensors that
autograd saved in forward see the weights again once backward re-gathers into
it. The module attributes are `params`: one leaf tensor per original
parameter, made once on `full`'s storage (`set_`, not a view: each has a
version counter of its own, so the collectives writing into `full` do not trip
autograd's in-place check). Outside a gather each shows 0 elements (its
`.data` swapped to an empty tensor, and back to its view of `full` when a
gather completes; `.data` moves no version counter, so a leaf autograd saved
finds its view again): a freed weight read by mistake is an empty tensor, not
freed memory, and DeepSpeed's rule (a ZeRO-3 parameter is 0-sized unless
gathered, `ds_shape` its shape) holds for code written against it. A unit
whose backward reads no weights is not gathered for it: its attributes take
their shapes on the empty storage for that backward (`show_shapes`), as
autograd checks a leaf's shape when its gradient arrives. Autograd
accumulates each one's gradient like a plain parameter's (AccumulateGrad, run
as soon as the gradient is complete); its post-accumulate hook copies it into
the unit's flat gradient `grad` and drops it, and when every parameter the
unit's backward reaches has arrived the unit is handed to the reduce pipeline. Per-parameter leaves, not one flat leaf
cut by `split`, because a split's backward node is made when the unit's
forward begins: for the root that is the first node of the graph, which
autograd's CPU engine runs last, so the head's gradient and the root's weights
waited for the end of backward; and the split's `cat` held every gradient of
the unit twice. A parameter that a step's backward does not reach (unused)
is learnt: the unit is reduced at the end of that backward, and from then on
when the parameters it did reach have arrived (one arriving later still gets
reduced, at the end of backward). A graph backwarded later accumulates again.

[Note: updates the engine cannot see]
hpZ's secondary shard is dropped (qWD: refreshed by a delta) after every
optimizer step over the master shard and whenever the shard's version counter
moves (`load_state_dict`, in-place ops) or its storage is replaced
(`p.data = ...`). An in-place write through `.data` changes neither: after one,
call `zeropp.refresh(model)`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from .collectives import Comm
from .config import Config
from .deferred import materialize, release
from .grads import route_for
from .layout import ShardLayout
from .quant import edit_wire, quantize
from .topology import Topology
from .weights import Gather, WeightPath, WeightSpec


@dataclass
class ParamInfo:
    """One original parameter: where it sits in the flat buffer and who holds it."""

    fqns: list[str]                     # every name it is reachable under (tied: several)
    registrations: list[tuple[nn.Module, str]]
    shape: torch.Size
    numel: int
    offset: int


class State(enum.Enum):
    """Where a flat buffer's full weights are, and what its module attributes show."""

    FREED = "freed"            # `full` holds no storage; the attributes show 0 elements
    GATHERING = "gathering"    # a gather is in flight (`pending`); the attributes show
    #                            what they showed before it
    GATHERED = "gathered"      # `full` holds the weights; the attributes are its views
    SHAPED = "shaped"          # freed, the attributes show their shapes: a backward that
    #                            reads none of these weights is under way (see the note)


# The moves `FlatParam._move` makes: the only place the state changes.
_MOVES = {State.FREED: {State.GATHERING, State.SHAPED},
          State.SHAPED: {State.GATHERING, State.FREED},
          State.GATHERING: {State.GATHERED, State.FREED},  # FREED: the gather failed
          State.GATHERED: {State.FREED}}


# owner_of's table: id(tensor) -> (the tensor, its FlatParam), both weakly (tensors
# compare elementwise), for every master shard and module attribute zeropp hands out.
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def owner_of(t: Any) -> Optional[FlatParam]:
    """The FlatParam whose master shard or module attribute `t` is, or None."""
    entry = _OWNERS.get(id(t))
    return entry[1]() if entry is not None and entry[0]() is t else None


class FlatParam:
    def __init__(self, params: list[tuple[nn.Parameter, list[tuple[nn.Module, str]], list[str]]],
                 *, topo: Topology, cfg: Config, compute_dtype: torch.dtype,
                 trainable: bool, name: str = "_zeropp_flat0", param_group: int = -1,
                 sync: Optional[Callable[[torch.Tensor], None]] = None,
                 persistent: bool = False) -> None:
        self.name = name  # as registered on its unit's module, e.g. "blocks.0._zeropp_flat0"
        # What a front door adds to the tensors zeropp hands out (the DeepSpeed one: its
        # `ds_*` attributes), set per model by `set_hooks`.
        self.hooks: Any = None
        self.param_group = param_group  # index into shard()'s param_groups (-1: in none)
        self.unit: Any = None  # the Unit that gathers it (set by the Unit)
        self.meter: Any = None  # its model's meter.GatherMeter (set by the Unit)
        self.trainable, self.compute_dtype = trainable, compute_dtype
        # Stays gathered between steps (Config.persistence_threshold): freed only to
        # be gathered again from new master weights.
        self.persistent = persistent
        self.gathered_for: Optional[tuple] = None  # master version the full weights show
        self.world_size = w = topo.world_size
        self.rank = topo.rank
        self.infos: list[ParamInfo] = []
        offset = 0
        for p, regs, fqns in params:
            self.infos.append(ParamInfo(fqns, regs, p.shape, p.numel(), offset))
            offset += p.numel()
        self.numel = offset
        # qwZ: weights travel as `weight_bits` integers; frozen ones may be stored so.
        self.int_storage = not trainable and cfg.quantized_nontrainable_weights
        self.quantized_gather = cfg.quantized_weights or self.int_storage
        self.weight_bits = cfg.weight_bits
        lay = ShardLayout.of(self.numel, w, cfg)  # (layout.py)
        self.block, self.shard_numel, self.padded_numel = lay.block, lay.shard_numel, \
            lay.padded_numel
        # Elements of this rank's shard that hold parameters (the rest is padding).
        self.shard_valid = lay.valid(topo.rank)
        device = params[0][0].device
        with torch.no_grad():
            flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
            for (p, _, _), info in zip(params, self.infos):
                # A parameter built under deferred_init() gets its values now, one at
                # a time, and gives back its storage (deferred.py).
                flat[info.offset:info.offset + info.numel].copy_(materialize(p).reshape(-1))
                release(p)
            if sync is not None:
                sync(flat)
            shard = flat[topo.rank * self.shard_numel:(topo.rank + 1) * self.shard_numel]
            if self.int_storage:  # stored as the wire bytes it is gathered as
                shard = quantize(shard, self.weight_bits, self.block).to_bytes()
            self.primary_shard = nn.Parameter(shard.clone(), requires_grad=trainable)
        del flat
        self.full = torch.empty(self.padded_numel, dtype=compute_dtype, device=device)
        # The module attributes, for the flat's lifetime (see the note): each shows
        # its view of `full` while gathered and 0 elements otherwise.
        self._views = [self._param_on_full(info) for info in self.infos]
        self._empty = torch.empty(0, dtype=compute_dtype, device=device)
        self.params = [self._param_on_full(info) for info in self.infos]
        self.grad: Optional[torch.Tensor] = None  # the flat gradient being assembled
        self.arrived: set[int] = set()    # params in `grad`
        self.seen: set[int] = set()       # params reached by this backward
        self.expected = set(range(len(self.infos)))  # params backward reaches (learnt)
        me = weakref.ref(self)  # a tensor's hooks are invisible to Python's gc: no cycle

        def grad_ready(t: torch.Tensor, i: int) -> None:
            flat = me()
            if flat is not None:
                flat._param_grad_ready(i, t)
        for i, t in enumerate(self.params):
            if trainable:
                t.requires_grad_(True)
                t.register_post_accumulate_grad_hook(functools.partial(grad_ready, i=i))
        self.pending: Optional[Gather] = None
        self.state = State.FREED
        self.full.untyped_storage().resize_(0)
        self._attach(False)
        self._status(False)
        self.install_attributes()  # before any gather, so modules keep their attributes
        self.needs_reduce = False  # a forward recorded for backward read the weights
        self.on_grad_ready: Optional[Callable[[FlatParam], None]] = None
        # gathers, hpZ secondary, qWD (a persistent flat is never gathered for a
        # backward: no secondary to keep)
        spec = WeightSpec.of(lay, self.weight_bits if self.quantized_gather else None,
                             self.int_storage)
        self.weights = WeightPath(spec, topo, dataclasses.replace(
            cfg, hpz_partition_size=1, weight_delta=False) if persistent else cfg,
            trainable=trainable, version=lambda: self.version)
        for t in (self.primary_shard, *self.params):
            key = id(t)
            _OWNERS[key] = (weakref.ref(t, lambda _r, k=key: _OWNERS.pop(k, None)),
                            weakref.ref(self))
        # How its gradient is reduced (grads/): ZeRO-3's ring or qgZ's two hops.
        self.reduce_route = route_for(cfg, block=self.block) if trainable else None

    @property
    def gathered(self) -> bool:
        return self.state is State.GATHERED

    @property
    def stale(self) -> bool:
        """A persistent flat's full weights predate a write to the master shard."""
        return self.persistent and self.gathered and self.gathered_for != self.version

    @property
    def version(self) -> tuple[int, int]:
        """Changes when the master shard is written in place or replaced."""
        p = self.primary_shard
        return p._version, p.data_ptr()

    def _move(self, to: State) -> None:
        """The one place the state changes, and what each state shows."""
        if to not in _MOVES[self.state]:
            raise RuntimeError(f"zeropp internal error: {self.name} {self.state.name} -> "
                               f"{to.name}")
        self.state = to
        if to is not State.GATHERING:
            self._attach(to is not State.FREED)
        if to in (State.GATHERED, State.FREED):
            self._status(to is State.GATHERED)

    # ---- gather / free -------------------------------------------------------
    def issue_gather(self, comm: Comm, *, phase: str) -> bool:
        """Start gathering the full weights (the route: see weights/); False if
        gathered or in flight."""
        if self.state in (State.GATHERED, State.GATHERING):
            return False
        nbytes = self.padded_numel * self.full.element_size()
        self.full.untyped_storage().resize_(nbytes)
        if self.meter is not None:
            self.meter.allocated(self, nbytes)
        # Buffers made here outlive the forward (hpZ secondaries, qWD copies): under
        # inference_mode they would become inference tensors, which training may not
        # update in place.
        with torch.inference_mode(False):
            self.pending = self.weights.issue(comm, phase, self.primary_shard.detach(),
                                              self.full)
        self._move(State.GATHERING)
        return True

    def wait_gather(self) -> None:
        if self.state is not State.GATHERING:
            return
        gather, self.pending = self.pending, None
        try:
            with torch.inference_mode(False):
                self.weights.finish(gather)
        except BaseException:
            # Not finished twice (a qWD delta would apply twice): the buffer is let go
            # (a timed-out collective may still write into it) and the secondary,
            # perhaps half updated, dropped for a full refresh.
            self.weights.invalidate()
            self._new_buffer()
            self._free_storage()
            raise
        self.gathered_for = self.version
        self._move(State.GATHERED)

    def free(self, let_go: bool = False, *, force: bool = False) -> None:
        """Free the full weights: in place (the storage resized to 0 bytes, which
        the forward relies on: see the note), or with `let_go` by dropping this
        flat's references to them and starting a new buffer, so a tensor someone
        else took from them keeps its values (its memory is freed when it dies).
        A persistent flat stays gathered unless `force`d."""
        self.wait_gather()
        if not self.gathered or (self.persistent and not force):
            return
        if let_go:  # a new buffer (emptied below, never written); the old one lives on
            self._new_buffer()
        self._free_storage()

    def _new_buffer(self) -> None:
        self.full = torch.empty_like(self.full)
        self._views = [self._param_on_full(info) for info in self.infos]

    def _free_storage(self) -> None:
        self.full.untyped_storage().resize_(0)
        if self.meter is not None:
            self.meter.freed(self)
        self._move(State.FREED)

    def set_hooks(self, hooks: Any) -> None:
        """`hooks.on_tensor(t, flat, info, kind)` for each tensor it hands out ("master",
        info None; "attribute"; later "placeholder": a state dict's 0-element entry) and
        `hooks.on_status(flat, available)` at each gather and free (and now)."""
        self.hooks = hooks
        hooks.on_tensor(self.primary_shard, self, None, "master")
        for t, info in zip(self.params, self.infos):
            hooks.on_tensor(t, self, info, "attribute")
        hooks.on_status(self, self.gathered)

    def _status(self, available: bool) -> None:
        if self.hooks is not None:
            self.hooks.on_status(self, available)

    def _attach(self, to_views: bool) -> None:
        """The module attributes show their views of `full`, or 0 elements."""
        for t, view in zip(self.params, self._views):
            # `.data`, not set_(): no version bump; autograd's saved leaves stay valid.
            t.data = view if to_views else self._empty

    def show_shapes(self) -> None:
        """A backward that reads none of these weights (an embedding's) is coming:
        the attributes take their shapes (on the freed storage) for its duration,
        because autograd checks a leaf's shape when its gradient arrives."""
        if self.state is State.FREED:
            self._move(State.SHAPED)

    def settle(self) -> None:
        """After the backward: not gathered, the attributes show 0 elements again."""
        if self.state is State.SHAPED:
            self._move(State.FREED)

    # ---- module attributes ---------------------------------------------------
    def _param_on_full(self, info: ParamInfo) -> torch.Tensor:
        """A tensor of `info.shape` on `full`'s storage at `info.offset`."""
        return torch.empty(0, dtype=self.full.dtype, device=self.full.device).set_(
            self.full.untyped_storage(), info.offset, info.shape)

    def use_views(self) -> None:
        """A forward is about to read the gathered weights: its gradient will
        need reducing (if it is recorded)."""
        if self.trainable and torch.is_grad_enabled():
            self.needs_reduce = True
        self.install_attributes()

    def install_attributes(self) -> None:
        """The modules' attributes are this flat's tensors again (code may have
        replaced one since), showing what the state says."""
        self._attach(self.state in (State.GATHERED, State.SHAPED))
        for t, info in zip(self.params, self.infos):
            for mod, attr in info.registrations:
                mod.__dict__[attr] = t  # plain attribute: the Parameter was removed

    # ---- gradients -----------------------------------------------------------
    def _param_grad_ready(self, i: int, t: torch.Tensor) -> None:
        """Parameter i's gradient is complete for this backward: into `grad`."""
        g, t.grad = t.grad, None
        info = self.infos[i]
        if self.grad is None:  # zeroed where nothing arrives, in take_grad
            self.grad = torch.empty(self.padded_numel, dtype=g.dtype, device=g.device)
        dst = self.grad[info.offset:info.offset + info.numel].view(info.shape)
        if i in self.arrived:
            dst.add_(g)
        else:
            dst.copy_(g)
        self.arrived.add(i)
        self.seen.add(i)
        if self.arrived >= self.expected and self.on_grad_ready is not None:
            self.on_grad_ready(self)

    def end_backward(self) -> bool:
        """Learn which parameters backward reaches; True if a gradient is still
        waiting (some expected parameter did not arrive): reduce it now."""
        if self.seen:
            self.expected, self.seen = self.seen, set()
        return self.grad is not None

    def drop_grad(self) -> None:
        """Forget a gradient an interrupted backward left behind."""
        self.grad, self.arrived, self.seen, self.needs_reduce = None, set(), set(), False
        for t in self.params:
            t.grad = None

    def take_grad(self) -> torch.Tensor:
        """This backward's full flat gradient (zeros where nothing arrived); the
        next backward starts a fresh one."""
        self.needs_reduce = False
        g, self.grad = self.grad, None
        for i, info in enumerate(self.infos):
            if i not in self.arrived:
                g[info.offset:info.offset + info.numel].zero_()
        g[self.numel:].zero_()
        self.arrived = set()
        return g

    @property
    def grad_codec(self) -> Any:
        """The gradient route's state (qgZ's inter-node codec), or None."""
        return self.reduce_route.codec if self.reduce_route is not None else None

    def accumulate_grad(self, part: torch.Tensor) -> None:
        """This rank's chunk of a reduced gradient (the mean, fp32) into the
        master shard's `.grad`, accumulating micro-batches."""
        # Padding must stay exactly zero (it is part of every later gather).
        part[self.shard_valid:] = 0
        p = self.primary_shard
        if p.grad is None:
            p.grad = part
        else:
            p.grad.add_(part)

    # ---- writes from outside the optimizer ------------------------------------
    def write_param(self, i: int, value: torch.Tensor) -> None:
        """Parameter i's full value `value`: this rank's slice into its master shard."""
        self.write_range(self.infos[i].offset, value)

    @torch.no_grad()
    def write_range(self, offset: int, value: torch.Tensor) -> None:
        """`value` (flattened) is the flat buffer's elements from `offset` on: this
        rank's slice of it into its master shard."""
        lo, n = self.rank * self.shard_numel, value.numel()
        a, b = max(lo, offset), min(lo + self.shard_numel, offset + n)
        if a >= b:
            return
        piece = value.detach().reshape(-1)[a - offset:b - offset]
        if not self.int_storage:
            self.primary_shard[a - lo:b - lo] = piece  # in place: bumps the version counter
            return
        changed = torch.zeros(self.shard_numel, dtype=torch.bool, device=piece.device)
        changed[a - lo:b - lo] = True
        values = torch.zeros(self.shard_numel, dtype=torch.float32, device=piece.device)
        values[a - lo:b - lo] = piece
        self.write_shard(values, changed)

    @torch.no_grad()
    def write_shard(self, values: torch.Tensor, changed: torch.Tensor) -> None:
        """`values[changed]` into this rank's master shard (`changed`: a mask over it)."""
        p = self.primary_shard
        if not self.int_storage:
            p[changed] = values[changed].to(p.dtype)  # in place: bumps the version counter
            return
        p.copy_(edit_wire(p.detach(), values, changed, bits=self.weight_bits, block=self.block))
