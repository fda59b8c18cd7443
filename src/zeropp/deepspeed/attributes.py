"""DeepSpeed's ZeRO-3 parameter attributes on the tensors zeropp hands out.

Libraries written for DeepSpeed inspect parameters: `ds_status` (TRL gathers
`lm_head.weight` when it is not AVAILABLE), `ds_shape` / `ds_numel` (the full
shape of a parameter that shows 0 elements), `ds_id`, `ds_persist`. zeropp's
engine knows nothing of them: a model the DeepSpeed front door shards (`initialize`,
or `zeropp.shard` of a model built under `zero.Init`) gets `HOOKS` on each of its
flat buffers (`FlatParam.set_hooks`), which the engine calls for every tensor it
hands out in place of an original parameter and when a unit's full weights become
available or are freed. A model sharded by plain `zeropp.shard` carries none.
Which flat buffer a tensor belongs to is the core's (`flat_views.owner_of`).
"""

from __future__ import annotations

import enum
from typing import Optional

import torch
from torch import nn

from ..flat_param import FlatParam
from ..flat_views import ParamInfo, owner_of
from ..shard import get_state

__all__ = ["ZeroParamStatus", "HOOKS", "attach", "owner_of"]


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's name for a ZeRO-3 parameter's state (`param.ds_status`)."""
    AVAILABLE = 1      # gathered: the full weights are in place
    NOT_AVAILABLE = 2  # partitioned: only the shard exists
    INFLIGHT = 3       # a gather is in flight


class _Hooks:
    @staticmethod
    def on_tensor(t: torch.Tensor, flat: FlatParam, info: Optional[ParamInfo],
                  kind: str) -> None:
        if info is not None:
            t.ds_shape, t.ds_numel = info.shape, info.numel
        if kind == "attribute":
            t.ds_id, t.ds_persist = info.fqns[0], flat.persistent
            t.ds_status = ZeroParamStatus.NOT_AVAILABLE

    @staticmethod
    def on_status(flat: FlatParam, available: bool) -> None:
        status = ZeroParamStatus.AVAILABLE if available else ZeroParamStatus.NOT_AVAILABLE
        for t in flat.params:
            t.ds_status = status


HOOKS = _Hooks()


def attach(model: nn.Module) -> None:
    """DeepSpeed's attributes on every tensor of the sharded `model`, from now on."""
    for f in get_state(model).flats:
        if f.hooks is not HOOKS:
            f.set_hooks(HOOKS)
