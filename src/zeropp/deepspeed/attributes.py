"""DeepSpeed's ZeRO-3 parameter attributes on the tensors zeropp hands out.

Libraries written for DeepSpeed inspect parameters: `ds_status` (TRL gathers
`lm_head.weight` when it is not AVAILABLE), `ds_shape` / `ds_numel` (the full
shape of a parameter that shows 0 elements), `ds_id`, `ds_persist`. zeropp's
engine knows nothing of them: it calls `FlatParam.on_tensor` for every tensor
it hands out in place of an original parameter and `FlatParam.on_status` when
a unit's full weights become available or are freed, and this module (imported
with `zeropp`) answers both. It also keeps which flat buffer a tensor belongs
to (`owner_of`), for `GatheredParameters` and the tensor-fragment API.
"""

from __future__ import annotations

import enum
import weakref
from typing import Optional

import torch

from ..flat_param import FlatParam, ParamInfo


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's name for a ZeRO-3 parameter's state (`param.ds_status`)."""
    AVAILABLE = 1      # gathered: the full weights are in place
    NOT_AVAILABLE = 2  # partitioned: only the shard exists
    INFLIGHT = 3       # a gather is in flight


# Tensor id -> (the tensor, its FlatParam), both weakly.
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def owner_of(t: torch.Tensor) -> Optional[FlatParam]:
    """The FlatParam whose master shard or module attribute `t` is, or None."""
    entry = _OWNERS.get(id(t))
    if entry is None or entry[0]() is not t:
        return None
    return entry[1]()


def _on_tensor(t: torch.Tensor, flat: FlatParam, info: Optional[ParamInfo], kind: str) -> None:
    if kind != "placeholder":
        _OWNERS[id(t)] = (weakref.ref(t), weakref.ref(flat))
    if info is not None:
        t.ds_shape, t.ds_numel = info.shape, info.numel
    if kind == "attribute":
        t.ds_id, t.ds_persist = info.fqns[0], flat.persistent
        t.ds_status = ZeroParamStatus.NOT_AVAILABLE


def _on_status(flat: FlatParam, available: bool) -> None:
    status = ZeroParamStatus.AVAILABLE if available else ZeroParamStatus.NOT_AVAILABLE
    for t in flat.params:
        t.ds_status = status


FlatParam.on_tensor.append(_on_tensor)
FlatParam.on_status.append(_on_status)
