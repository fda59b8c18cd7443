"""Coalesced gradient reduction: several backwards, one reduce-scatter per unit.

Inside `coalesced_reduction(model)` a unit whose gradient is complete is not
handed to the reduce pipeline: its flat gradient is added to a held gradient
of its own on this rank, unreduced. Every backward in the block sums into that
one full gradient per unit; at the block's exit each goes once, in unit order,
through the reduction the model always uses (plain ring, qgZ's two hops,
whatever the Config says), and the mean over the ranks is added to the master
shard's `.grad` as a backward's is. N backwards then cost one reduction per
unit instead of N (DeepSpeed's `engine.coalesce_grad_reduction()`).

[Note: what the held gradient costs and what it sums]
Held gradients are fp32 (wider compute dtypes stay as they are): the sum of N
micro-batches is then as precise as the N reduced means it replaces, which
zeropp accumulates in fp32 in `.grad`. The price is memory: each trainable
unit's full, unsharded gradient stays resident on every rank for the whole
block (a model's fp32 size), where outside the block at most
`reduce_buckets` units' are alive. Nothing is divided at the exit but by the
world size, inside the reduction: each backward already carried its own
scaling (the engine's 1/gradient_accumulation_steps), as outside the block.
The result differs from N separate reductions only by the order of the sums
(fp32 rounding); with qgZ, by quantizing the sum once instead of N terms.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn

from ..flat_param import FlatParam
from ..shard import get_state


class HeldGradients:
    """Each flat parameter's gradient summed over a coalesced block's backwards,
    unreduced (this rank's own)."""

    def __init__(self) -> None:
        self.grads: dict[FlatParam, torch.Tensor] = {}

    def add(self, flat: FlatParam, g: torch.Tensor) -> None:
        """Add `g` (the flat's own buffer, from FlatGrad.take) to the flat's held gradient."""
        held = self.grads.get(flat)
        if held is None:
            self.grads[flat] = g.to(torch.promote_types(g.dtype, torch.float32))
        else:
            held.add_(g)

    def get(self, flat: FlatParam) -> Optional[torch.Tensor]:
        return self.grads.get(flat)


@contextmanager
def coalesced_reduction(model: nn.Module) -> Iterator[HeldGradients]:
    """Hold every unit's gradient over the block's backwards; reduce each once at
    its exit (see the module docstring). Collective at the exit: every rank runs
    the block with the same units reached. A block left by an exception reduces
    nothing and drops what it held (one rank's failure must not leave the others
    waiting in a collective), as an interrupted backward's gradient is dropped."""
    st = get_state(model)
    if st.held is not None:
        raise RuntimeError("zeropp: coalesced gradient reduction cannot be nested")
    st.reducer.drain()  # a reduction still in flight lands before the block
    held = st.held = HeldGradients()
    try:
        yield held
    except BaseException:
        st.held = None
        raise
    st.held = None
    for u in st.units:  # unit order: the same collectives in the same order on every rank
        for f in u.flats:
            g = held.grads.pop(f, None)
            if g is not None:
                u.submit_reduce(f, g)
    st.reducer.drain()
