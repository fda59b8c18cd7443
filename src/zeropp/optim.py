"""Optimizer-side helpers that must see the whole model, not one shard."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .shard import get_state


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of a sharded model by their global norm, like
    `torch.nn.utils.clip_grad_norm_` on the unsharded model; returns the norm.

    One all-reduce of two numbers, this rank's part of the norm and whether it is NaN (gloo's
    MAX keeps or drops a NaN by the order it compares); padding has zero gradient. A NaN or Inf
    gradient on any rank makes the norm non-finite on every rank (gradients too, as in torch)."""
    if not max_norm > 0:  # (torch's own would flip or zero every gradient)
        raise ValueError(f"zeropp.clip_grad_norm_: max_norm must be > 0 (inf: no clipping), got {max_norm}")
    st = get_state(model)
    if (norm_type := float(norm_type)) not in (2.0, float("inf")):
        raise ValueError(f"zeropp.clip_grad_norm_: norm_type={norm_type} unsupported (2.0, inf)")
    st.comm.unit = "<all: gradient norm>"
    grads = [f.primary_shard.grad for f in st.flats if f.primary_shard.grad is not None]
    device = st.flats[0].primary_shard.device if st.flats else torch.device("cpu")
    l2 = norm_type == 2.0
    local = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        local = (local + g.float().pow(2).sum() if l2
                 else torch.maximum(local, g.float().abs().max()))
    both = torch.stack([local.nan_to_num(0.0, posinf=torch.inf), local.isnan().float()])
    total, nan = st.comm.all_reduce(both, op="all_reduce/grad_norm",
                                    reduce_op=dist.ReduceOp.SUM if l2 else dist.ReduceOp.MAX)
    total = torch.where(nan > 0, torch.nan, total.sqrt() if l2 else total)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total
