"""A unit's hooks: when its weights are gathered, freed and its gradient reduced.

Per unit and iteration:
  forward pre-hook   wait for its gather (prefetched earlier), prefetch the next
                     unit, point the module's parameters at the full weights
  forward post-hook  free the full weights; hook the outputs for backward
  output grad hook   (backward reaches this unit) gather again, prefetch the
                     unit backward reaches next
  param grad hooks   its gradient is complete: hand it to the reduce pipeline
                     (grads/pipeline.py; reduced on two threads while backward goes on), free
  end of backward    (shard.ShardState) wait for every reduction, free leftovers
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .flat_param import FlatParam

if TYPE_CHECKING:
    from .shard import ShardState

_WEIGHTLESS_BACKWARD = (nn.Embedding.forward, nn.EmbeddingBag.forward)


class Unit:
    def __init__(self, name: str, module: nn.Module, flats: list[FlatParam],
                 state: ShardState) -> None:
        self.name, self.module, self.flats, self.state = name, module, flats, state
        self.is_root, self.label = name == "", name or "<root>"
        self.backward_gathered = False
        # An embedding lookup's backward scatters the output gradient into rows without reading the
        # weights: its unit is not gathered for backward (a 32k x 2048 fp32 vocabulary: 262 MB at
        # the end of backward, and its wire bytes). Only torch's own forward is known to be so.
        self.backward_reads_weights = type(module).forward not in _WEIGHTLESS_BACKWARD
        self.pins = 0  # zeropp.gathered() contexts holding the full weights resident
        self.hooks_inputs = self.input_grads_due = False  # _PostBackward's (free_when_done)
        for f in flats:
            f.grads.on_ready = functools.partial(self._flat_grad_ready, f)
            f.unit, f.meter = self, state.meter

    def __repr__(self) -> str:
        return f"Unit({self.label})"

    def issue_gather(self, prefetch: bool = False) -> None:
        self.state.comm.unit = self.label
        phase = "backward" if self.state.backward_active else "forward"
        issued = [f.issue_gather(self.state.comm, phase=phase) for f in self.flats]
        if any(issued):
            self.state.stats.count_unit(self.label, f"all_gather/{phase}")
            if prefetch:
                self.state.stats.count_unit(self.label, f"prefetch/{phase}")

    def wait(self) -> None:
        for f in self.flats:
            f.wait_gather()

    def free(self, let_go: bool = False) -> None:
        """Free the full weights (`let_go`: FlatParam.free) unless zeropp.gathered() pins them."""
        for f in () if self.pins else self.flats:
            f.free(let_go)

    # ---- hooks -----------------------------------------------------------------
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        st = self.state
        if self.is_root and not _in_backward():
            st.begin_iteration()
        # Issue this unit's gather (if not prefetched), then the next ones, then wait: the link
        # carries the next gather while this one is dequantized, not idle until this one is ready.
        self.issue_gather()
        if not st.backward_active:
            st.forward_order.append(self)
            st.prefetch_forward()
        self.wait()
        for f in self.flats:
            f.use_views()
        if st.cfg.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), st.cfg.param_dtype)
        if self.flats and torch.is_grad_enabled() and not all(f.grads.on for f in self.flats):
            # Frozen weights: no leaf gradient says when backward is done; the inputs' does.
            args, kwargs = _PostBackward.attach(self, args, kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        st = self.state
        if st.backward_active:
            return output  # recomputation inside backward: weights still needed
        self.free()
        hooked = [t for t in _tensors(output) if t.requires_grad] if torch.is_grad_enabled() else []
        for t in hooked:
            t.register_hook(self._pre_backward)
        if hooked:  # only units that backward will reach are worth prefetching
            st.finished_order.append(self)
        if self.is_root:
            st.end_forward()
        return output

    def _pre_backward(self, grad: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            raise RuntimeError("zeropp: backward with create_graph=True (double backward, e.g. a "
                               "gradient penalty) through sharded units is not supported: their "
                               "weights are freed after use")
        if any(f.gathered_for != f.version for f in self.flats):  # torch's in-place check, here
            raise RuntimeError(f"zeropp: {self.label}'s weights changed between its forward and "
                               "this backward (an optimizer step?): torch refuses it too")
        st = self.state
        st.begin_backward()
        self.input_grads_due = self.hooks_inputs
        if not self.backward_reads_weights:
            self.backward_gathered = True
            for f in self.flats:
                f.show_shapes()
            return
        # Gather even if this backward gathered the unit before: a unit used by two graphs (or twice
        # in one) may have been freed after its first use. Issue, prefetch, wait (as pre_forward).
        self.issue_gather()
        if not self.backward_gathered:
            self.backward_gathered = True
            st.prefetch_backward(self)
        self.wait()

    def _flat_grad_ready(self, flat: FlatParam) -> None:
        self.state.begin_backward()
        self.reduce(flat)
        self.free_when_done()

    def free_when_done(self) -> None:
        # Backward is past every use of the weights only if every gradient came (a flat that learnt
        # to expect fewer may still get one) and, where a forward hooked the inputs, theirs: frozen
        # weights (a LoRA base's) serve the inputs' gradient after every trainable one came.
        if not self.input_grads_due and not any(
                f.grads.on and (f.grads.needs_reduce or f.grads.expected != f.grads.everything)
                for f in self.flats):
            self.free()

    def reduce(self, flat: FlatParam) -> None:
        g = flat.grads.take()
        if self.state.held is not None:  # inside coalesced_reduction: reduced at its exit
            self.state.held.add(flat, g)
        else:
            self.submit_reduce(flat, g)

    def submit_reduce(self, flat: FlatParam, g: torch.Tensor) -> None:
        st = self.state
        st.stats.count_unit(self.label, "reduce_scatter")
        route = flat.buffer.route
        st.reducer.submit(self.label, g, lambda comm: route.first(comm, g), route.second,
                          flat.grads.accumulate)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward marks the unit's backward done."""

    @staticmethod
    def forward(ctx, unit: Unit, *tensors: torch.Tensor):
        ctx.unit = unit
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.input_grads_due = False
        ctx.unit.free_when_done()
        return (None, *grads)

    @staticmethod
    def attach(unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        leaves, spec = tree_flatten((args, kwargs))
        idx = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not idx:
            return args, kwargs
        unit.hooks_inputs = unit.input_grads_due = True
        outs = _PostBackward.apply(unit, *(leaves[i] for i in idx))
        for i, o in zip(idx, outs):
            leaves[i] = o
        return tree_unflatten(leaves, spec)


def _graph_task() -> int:
    """The backward autograd is running on this thread right now (-1: none)."""
    return torch._C._current_graph_task_id()


def _in_backward() -> bool:
    return _graph_task() != -1


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output: pytrees, and dataclasses inside them."""
    found = []
    for leaf in tree_flatten(output)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += _tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
    return found


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor)
                    and t.is_floating_point() and t.dtype != dtype else t, tree)
