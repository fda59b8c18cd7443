"""FlatGrad: a flat buffer's gradient, assembled from its parameters' own.

[Note: how a unit's gradient is assembled]
Autograd accumulates each module attribute's gradient like a plain parameter's (AccumulateGrad, run
once the gradient is complete); its post-accumulate hook hands it here: copied into the flat
gradient `grad` and dropped. When every parameter the unit's backward reaches has arrived, the unit
is told (`on_ready`) and hands the flat to the reduce pipeline. Per-parameter leaves, not one flat
leaf cut by `split`: a split's backward node is made when the unit's forward begins, for the root
the graph's first node, which autograd's CPU engine runs last (the head's gradient and the root's
weights waited for the end of backward); and the split's `cat` held every gradient of the unit
twice. Parameters a step's backward does not reach (unused) are learnt: the unit is reduced at the
end of that backward, and from then on once the parameters it did reach have arrived (one arriving
later is still reduced at the end of backward). A graph backwarded later accumulates again. This
rank's chunk of the reduced mean is added to the master shard's `.grad` (`accumulate`), summing
micro-batches.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Optional

import torch


class FlatGrad:
    """The gradient of a flat buffer whose parameters are `params` (module attributes, placed
    as `infos` say) and whose master shard is `master` (its first `valid` elements hold
    parameters, the rest padding). Frozen (not `trainable`): none ever arrives."""

    def __init__(self, infos: list[Any], params: list[torch.Tensor], padded_numel: int,
                 master: torch.Tensor, valid: int, *, trainable: bool) -> None:
        self.infos, self.params, self.padded_numel = infos, params, padded_numel
        self.master, self.valid = master, valid
        self.numel = sum(info.numel for info in infos)
        self.grad: Optional[torch.Tensor] = None  # the flat gradient being assembled
        self.arrived: set[int] = set()    # params in `grad`
        self.seen: set[int] = set()       # params reached by this backward
        self.everything = set(range(len(infos)))
        self.expected = self.everything  # params backward reaches (learnt)
        self.needs_reduce = False  # a forward recorded for backward read the weights
        self.on = trainable  # the parameters' requires_grad, as use_views last set it
        self.on_ready: Optional[Callable[[], None]] = None
        me = weakref.ref(self)  # a tensor's hooks are invisible to Python's gc: no cycle

        def arrived(t: torch.Tensor, i: int) -> None:
            if (grads := me()) is not None:
                grads.arrive(i, t)
        for i, t in enumerate(params if trainable else []):
            t.requires_grad_(True)
            t.register_post_accumulate_grad_hook(functools.partial(arrived, i=i))

    def arrive(self, i: int, t: torch.Tensor) -> None:
        """Parameter i's gradient is complete for this backward: into `grad`."""
        g, t.grad = t.grad.to_dense(), None  # (itself unless sparse: an Embedding(sparse=True)'s)
        info = self.infos[i]
        if self.grad is None:  # zeroed where nothing arrives, in take
            self.grad = torch.empty(self.padded_numel, dtype=g.dtype, device=g.device)
        dst = self.grad[info.offset:info.offset + info.numel].view(info.shape)
        (dst.add_ if i in self.arrived else dst.copy_)(g)
        self.arrived.add(i)
        self.seen.add(i)
        if self.arrived >= self.expected and self.on_ready is not None:
            self.on_ready()

    def end_backward(self) -> bool:
        """Learn which parameters backward reaches; True if a gradient is still
        waiting (some expected parameter did not arrive): reduce it now."""
        if self.seen:
            self.expected, self.seen = self.seen, set()
        return self.grad is not None

    def drop(self) -> None:
        """Forget a gradient an interrupted backward left behind (not `needs_reduce`: a forward's
        backward may still come, after an eval forward or a zeropp.gathered() context)."""
        self.grad, self.arrived, self.seen = None, set(), set()
        for t in self.params:
            t.grad = None

    def take(self) -> torch.Tensor:
        """The backward's full flat gradient (zeros where nothing arrived); the next starts anew."""
        self.needs_reduce = False
        g, self.grad = self.grad, None
        for i, info in enumerate(self.infos):
            if i not in self.arrived:
                g[info.offset:info.offset + info.numel].zero_()
        g[self.numel:].zero_()
        self.arrived = set()
        return g

    def accumulate(self, part: torch.Tensor) -> None:
        """This rank's chunk of a reduced gradient (the mean, fp32) into the master
        shard's `.grad`, accumulating micro-batches."""
        if self.master._backward_hooks or self.master._post_accumulate_grad_hooks:
            raise RuntimeError(f"zeropp: a gradient hook on a master shard (model.parameters(); "
                               f"this one holds {self.infos[0].fqns[0]}) never runs: autograd does "
                               "not reach it. Hook the module's attribute, or act after backward")
        part[self.valid:] = 0  # padding stays exactly zero (it is part of every later gather)
        self.master.grad = part if self.master.grad is None else self.master.grad.add_(part)
