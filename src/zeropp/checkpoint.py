"""Consolidating a sharded model's weights (checkpoint files arrive later)."""

from __future__ import annotations

import torch
from torch import nn

from .shard import get_state


def full_state_dict(model: nn.Module, *, all_ranks: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded model's state dict (original names, fp32 parameters, buffers
    as they are), assembled from the master shards with one all-gather per flat
    parameter. Collective: every rank must call it. Returned on rank 0 (on every
    rank with `all_ranks=True`); other ranks get {}."""
    st = get_state(model)
    out: dict[str, torch.Tensor] = {}
    for u in st.units:
        for f in u.flats:
            full = f.gather_master(st.comm)
            out.update({k: v.clone() for k, v in f.unflatten(full).items()})
    if not all_ranks and st.topo.rank != 0:
        return {}
    for name, buf in model.named_buffers():
        out[name] = buf.detach().clone()
    return out
