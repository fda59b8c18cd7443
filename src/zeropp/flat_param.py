"""FlatParam: one unit's parameters flattened into one buffer and cut into W shards.

A unit's parameters of one kind (trainable or frozen, one compute dtype) are concatenated in fixed
order, zero-padded to a multiple of W and cut into W equal *primary shards*; rank r keeps shard r.

[Note: zeropp's tensors]
  primary shard   rank r's 1/W of a flat buffer, fp32 (frozen: maybe INT8 wire
                  bytes): the master weights, an nn.Parameter the optimizer steps
  full weights    `full`: the whole buffer at the compute dtype, alive between a
                  gather and the matching free
  module attributes  `params`: one tensor per original parameter on `full`'s storage
                  (0 elements while freed), what the model computes with (flat_views.py)
  secondary shard hpZ: W/P primary shards of the ranks in this rank's column, kept after
                  a forward so the backward gathers inside the node (weights/hpz.py's note)
  qWD copy        a secondary kept across steps as qwZ's INT8 blocks, moved by deltas
  wire bytes      a quantized tensor as it travels: fp32 scales, then codes (quant.py)
  flat gradient   `grads.grad`: a backward's full gradient of the buffer,
                  assembled from the per-parameter ones (flat_grad.py)

[Note: updates the engine cannot see]
hpZ's secondary shard is dropped (qWD: refreshed by a delta) after every optimizer
step over the master shard and whenever the shard's version counter moves
(`load_state_dict`, in-place ops) or its storage is replaced (`p.data = ...`). An
in-place write through `.data` changes neither: after one, call `zeropp.refresh(model)`.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from typing import Any, Callable, Optional

import torch
from torch import nn

from . import master_shard
from .buffer import ShardedBuffer, version_of
from .collectives import Comm
from .config import Config
from .flat_grad import FlatGrad
from .flat_views import FlatViews, ParamInfo, own
from .layout import ShardLayout
from .topology import Topology
from .weights import Gather


class State(enum.Enum):
    """Where a flat buffer's full weights are, and what its module attributes show."""

    FREED = "freed"            # `full` holds no storage; the attributes show 0 elements
    GATHERING = "gathering"    # a gather is in flight (`pending`); the attributes as before
    GATHERED = "gathered"      # `full` holds the weights; the attributes are its views
    SHAPED = "shaped"          # freed, the attributes show their shapes (`show_shapes`)


# The moves `FlatParam._move` makes: the only place the state changes.
_MOVES = {State.FREED: {State.GATHERING, State.SHAPED},
          State.SHAPED: {State.GATHERING, State.FREED},
          State.GATHERING: {State.GATHERED, State.FREED},  # FREED: the gather failed
          State.GATHERED: {State.FREED}}


class FlatParam:
    def __init__(self, params: list[tuple[nn.Parameter, list[tuple[nn.Module, str]], list[str]]],
                 *, topo: Topology, cfg: Config, compute_dtype: torch.dtype,
                 trainable: bool, name: str = "_zeropp_flat0", param_group: int = -1,
                 sync: Optional[Callable[[torch.Tensor], None]] = None,
                 persistent: bool = False) -> None:
        self.name = name  # as registered on its unit's module, e.g. "blocks.0._zeropp_flat0"
        self.hooks: Any = None  # what a front door adds to its tensors (DeepSpeed's ds_*)
        self.param_group = param_group  # index into shard()'s param_groups (-1: in none)
        self.unit: Any = None  # the Unit that gathers it (set by the Unit)
        self.meter: Any = None  # its model's meter.GatherMeter (set by the Unit)
        # persistent (Config.persistence_threshold): freed only to be gathered from new masters
        self.trainable, self.compute_dtype, self.persistent = trainable, compute_dtype, persistent
        self.gathered_for: Optional[tuple] = None  # master version the full weights show
        self.world_size, self.rank = topo.world_size, topo.rank
        offsets = [0, *itertools.accumulate(p.numel() for p, _, _ in params)]
        self.infos = [ParamInfo(fqns, regs, p.shape, p.numel(), offset)
                      for (p, regs, fqns), offset in zip(params, offsets)]
        self.numel = offsets[-1]
        # qwZ: weights travel as `weight_bits` integers; frozen ones may be stored so.
        self.int_storage = not trainable and cfg.quantized_nontrainable_weights
        self.quantized_gather = cfg.quantized_weights or self.int_storage
        self.weight_bits = cfg.weight_bits
        lay = ShardLayout.of(self.numel, self.world_size, cfg)  # (layout.py)
        self.block, self.shard_numel, self.padded_numel = lay.block, lay.shard_numel, \
            lay.padded_numel
        self.shard_valid = lay.valid(topo.rank)  # elements of parameters; then padding
        self.primary_shard = master_shard.make(
            [p for p, _, _ in params], self.infos, lay, topo.rank, sync=sync,
            bits=self.weight_bits if self.int_storage else None, trainable=trainable)
        self.full = self.primary_shard.new_empty(self.padded_numel, dtype=compute_dtype)
        # The module attributes (flat_views.py): views of `full` while gathered, else empty.
        self.views = FlatViews(self.infos, self.full)
        self.params = self.views.params
        # Its gradient, assembled from the attributes' own (flat_grad.py).
        self.grads = FlatGrad(self.infos, self.params, self.padded_numel, self.primary_shard,
                              self.shard_valid, trainable=trainable)
        self.pending: Optional[Gather] = None
        self.state = State.FREED
        self.full.untyped_storage().resize_(0)
        self.install_attributes()  # before any gather, so modules keep their attributes
        # Its gathers (hpZ's secondary, qWD: none for a persistent flat, never gathered
        # for a backward) and its gradient route (buffer.py).
        self.buffer = ShardedBuffer(
            lay, topo, dataclasses.replace(cfg, hpz_partition_size=1, weight_delta=False)
            if persistent else cfg, version=version_of([self.primary_shard]),
            bits=self.weight_bits if self.quantized_gather else None, trainable=trainable,
            stored_as_wire=self.int_storage)
        own(self, [self.primary_shard, *self.params])

    @property
    def gathered(self) -> bool:
        return self.state is State.GATHERED

    @property
    def stale(self) -> bool:
        """A persistent flat's full weights predate a write to the master shard."""
        return self.persistent and self.gathered and self.gathered_for != self.version

    @property
    def version(self) -> tuple:
        """Changes when the master shard is written in place or replaced."""
        return self.buffer.version()

    def _move(self, to: State) -> None:
        """The one place the state changes, and what each state shows."""
        if to not in _MOVES[self.state]:
            raise RuntimeError(f"zeropp internal error: {self.name} {self.state.name} -> {to.name}")
        self.state = to
        if to is not State.GATHERING:
            self.views.show(to is not State.FREED)
        if to in (State.GATHERED, State.FREED) and self.hooks is not None:
            self.hooks.on_status(self, to is State.GATHERED)

    # ---- gather / free -------------------------------------------------------
    def issue_gather(self, comm: Comm, *, phase: str) -> bool:
        """Start gathering the full weights (weights/); False if gathered or in flight."""
        if self.state in (State.GATHERED, State.GATHERING):
            return False
        nbytes = self.padded_numel * self.full.element_size()
        self.full.untyped_storage().resize_(nbytes)
        if self.meter is not None:
            self.meter.allocated(self, nbytes)
        # Buffers made here outlive the forward (hpZ secondaries, qWD copies): under
        # inference_mode they would be inference tensors, which training cannot update.
        with torch.inference_mode(False):
            self.pending = self.buffer.weights.issue(comm, phase, self.primary_shard.detach(),
                                                     self.full)
        self._move(State.GATHERING)
        return True

    def wait_gather(self) -> None:
        if self.state is not State.GATHERING:
            return
        gather, self.pending = self.pending, None
        try:
            with torch.inference_mode(False):
                self.buffer.weights.finish(gather)
        except BaseException:
            # Not finished twice (a qWD delta would apply twice): the buffer is let go (a
            # timed-out collective may still write it), a maybe half-updated secondary dropped.
            self.buffer.invalidate()
            self._new_buffer()
            self._free_storage()
            raise
        self.gathered_for = self.version
        self._move(State.GATHERED)

    def free(self, let_go: bool = False, *, force: bool = False) -> None:
        """Free the full weights: in place (storage resized to 0 bytes, which the forward relies on:
        flat_views.py's note), or with `let_go` by starting a new buffer: a tensor taken from the
        old one keeps its values. A persistent flat stays gathered unless `force`d."""
        self.wait_gather()
        if not self.gathered or (self.persistent and not force):
            return
        if let_go:  # a new buffer (emptied below, never written); the old one lives on
            self._new_buffer()
        self._free_storage()

    def _new_buffer(self) -> None:
        with torch.inference_mode(False):  # (gathered() left inside it: training gathers into it)
            self.full = torch.empty_like(self.full)
            self.views.renew(self.full)

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

    def show_shapes(self) -> None:
        """A backward that reads none of these weights (an embedding's) is coming: the
        attributes take their shapes for its duration (flat_views.py's note)."""
        if self.state is State.FREED:
            self._move(State.SHAPED)

    def settle(self) -> None:
        """After the backward: not gathered, the attributes show 0 elements again."""
        if self.state is State.SHAPED:
            self._move(State.FREED)

    def use_views(self) -> None:
        """A forward is about to read the weights: its gradient will need reducing (if recorded).
        A freeze through the master shard (`model.requires_grad_(False)`, a GAN's critic) holds for
        the forward: no gradient. Unfreezing a flat frozen at shard() (it has no route, no optimizer
        state) or changing one parameter's own `requires_grad` is refused by name."""
        if not torch.is_grad_enabled():
            return self.install_attributes()
        now = self.primary_shard.requires_grad
        bad = [i.fqns[0] for t, i in zip(self.params, self.infos) if t.requires_grad != self.grads.on]
        if bad or (now and not self.trainable):
            what = f"parameter {bad[0]}" if bad else f"{self.name} (with {self.infos[0].fqns[0]})"
            raise RuntimeError(f"zeropp: requires_grad of {what} changed after zeropp.shard(); set "
                               "it before sharding (a unit's parameters() freeze it whole)")
        if now != self.grads.on:
            self.grads.on = now
            for t in self.params:
                t.requires_grad_(now)
        self.grads.needs_reduce = now
        self.install_attributes()

    def install_attributes(self) -> None:
        """The modules' attributes are this flat's tensors again, showing what the state says."""
        self.views.install(self.state in (State.GATHERED, State.SHAPED))
