"""A backward the user runs on the engine's outputs (`loss = engine(x); loss.backward()`),
DeepSpeed's PyTorch-style backward (0.18.3 on): the gradients `engine.backward(loss)` gives.

[Note: where a direct backward is divided]
`engine.backward` divides the loss by gradient_accumulation_steps (GAS) and multiplies it by
the fp16 loss scale before autograd runs; a direct backward passes through neither. So the
engine's forward hands each output tensor back through `Through`, an identity whose backward
asks the engine what the gradient reaching that output becomes: unchanged when
`engine.backward` or `engine.scale(loss)` is behind this backward (the loss is scaled
already), divided by GAS otherwise, and refused under fp16 (unscaled fp16 gradients
underflow: DeepSpeed refuses too). A returned loss then gets the gradient 1/GAS, the bits
`engine.backward` gives it.
Each output is a new tensor (the same storage and version counter), not a hook on the model's
own: an HF model returns its loss and the logits the loss was computed from, and a hook on
those logits would divide the gradient that reaches them from the loss a second time
(`register_hook` sees every use); the identity sees only what comes back through the
returned object. Outputs in containers `torch.utils._pytree` does not know (a dataclass, a
cache object) are returned as they are, and a backward through them is not divided.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map


class Through(torch.autograd.Function):
    """Identity forward; backward: `engine._direct(grad)` (the note)."""

    @staticmethod
    def forward(ctx: Any, engine: Any, t: torch.Tensor) -> torch.Tensor:
        ctx.engine = engine
        return t.detach()  # an alias, not a view: in-place ops on the output stay allowed

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, ctx.engine._direct(grad)


def through(engine: Any, out: Any) -> Any:
    """`out` with every tensor that requires a gradient passed through `Through`."""
    if not torch.is_grad_enabled():
        return out
    return tree_map(lambda t: Through.apply(engine, t)
                    if isinstance(t, torch.Tensor) and t.requires_grad else t, out)
