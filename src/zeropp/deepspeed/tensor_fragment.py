"""`deepspeed.utils`' tensor-fragment API: read or write one parameter's fp32
value, gradient or optimizer state under ZeRO-3, whole (`safe_*_full_*`,
collective) or this rank's piece (`safe_*_local_*`, no communication).

A "parameter" is either a parameter of the original model (what
`engine.module.named_parameters()` yields, the module attribute `model.fc.weight`:
its own shape) or a unit's flat fp32 master shard (what the engine's optimizer
and `zeropp.shard`'s `parameters()` hold: its full value is the unit's flat
buffer, `ds_shape` elements). Its local piece is this rank's part of it: the whole master shard
(padding included, `ds_tensor`), or the original parameter's elements that fall
in this rank's shard (1-D, possibly empty). As in DeepSpeed, frozen parameters
have no fp32 master, gradient or optimizer state: their getters return None.

The full getters are collectives (one all-gather each): call them on every
rank, in the same order. The full setters take the same full value on every
rank and write each rank's slice (no communication); a weight write drops the
unit's hpZ secondaries and qWD copies on every rank, so the next gather is a
full one everywhere.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .. import master_shard
from ..checkpoint import gather_master
from ..flat_param import FlatParam
from .attributes import owner_of


def _locate(p: torch.Tensor) -> tuple[FlatParam, Optional[int]]:
    """The flat parameter of `p` and the index of `p` among its original
    parameters (None: `p` is the master shard itself)."""
    f = owner_of(p) if isinstance(p, torch.Tensor) else None
    if f is None:
        raise ValueError("deepspeed.utils tensor-fragment API: this tensor is not a parameter "
                         "of a model sharded by zeropp (initialize or zeropp.shard)")
    if p is f.primary_shard:
        return f, None
    return f, next(k for k, t in enumerate(f.params) if t is p)


def _span(f: FlatParam, i: Optional[int]) -> tuple[int, int, Any]:
    """(offset, numel, shape) of the parameter in the flat buffer."""
    if i is None:
        return 0, f.numel, (f.numel,)
    info = f.infos[i]
    return info.offset, info.numel, info.shape


def _full(f: FlatParam, i: Optional[int], local: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Collective: the full value of the parameter from every rank's shard-sized
    `local` (None on every rank: None)."""
    if local is None:
        return None
    comm = f.unit.state.comm
    comm.unit = "<all: tensor fragment>"
    out = torch.empty(f.padded_numel, dtype=local.dtype, device=local.device)
    comm.all_gather(out, local.detach().contiguous(), op="all_gather/tensor_fragment").wait()
    off, n, shape = _span(f, i)
    return out[off:off + n].view(shape).clone()


def _local_range(f: FlatParam, i: Optional[int]) -> tuple[int, int]:
    """The parameter's elements in this rank's shard, as shard indices [a, b)."""
    if i is None:
        return 0, f.shard_numel
    off, n, _ = _span(f, i)
    lo = f.rank * f.shard_numel
    a, b = max(lo, off), min(lo + f.shard_numel, off + n)
    return (a - lo, b - lo) if a < b else (0, 0)


def _full_span(f: FlatParam, i: Optional[int], value: torch.Tensor) -> tuple[int, int]:
    """(offset, numel) of the parameter, checking that `value` is its full size."""
    off, n, shape = _span(f, i)
    if value.numel() != n:
        raise ValueError(f"deepspeed.utils: a value of shape {tuple(value.shape)} for a "
                         f"parameter of shape {tuple(shape)}")
    return off, n


def _write_full(f: FlatParam, i: Optional[int], shard: torch.Tensor, value: torch.Tensor) -> None:
    """This rank's slice of the full `value` into the shard-sized `shard`."""
    off, n = _full_span(f, i, value)
    lo = f.rank * f.shard_numel
    a, b = max(lo, off), min(lo + f.shard_numel, off + n)
    if a < b:
        with torch.no_grad():
            shard[a - lo:b - lo] = value.detach().reshape(-1)[a - off:b - off]


def _optimizer_state(f: FlatParam, key: str) -> Optional[torch.Tensor]:
    ref = getattr(f.primary_shard, "_zeropp_optimizer", None)
    opt = ref() if ref is not None else None
    if opt is None:
        raise ValueError("deepspeed.utils optimizer-state API: this parameter's model has no "
                         "optimizer from deepspeed.initialize (zeropp.initialize)")
    state = opt.state.get(f.primary_shard, {}).get(key)
    return state if isinstance(state, torch.Tensor) and state.dim() == 1 else None


def _settable_state(f: FlatParam, key: str) -> torch.Tensor:
    state = _optimizer_state(f, key) if f.trainable else None
    if state is None:
        raise ValueError(f"deepspeed.utils: no optimizer state {key!r} for this parameter "
                         "(frozen, or before the first step)")
    return state


def _grad(f: FlatParam, create: bool = False) -> Optional[torch.Tensor]:
    p = f.primary_shard
    if p.grad is None and create:
        p.grad = torch.zeros_like(p)
    return p.grad


# ---- full values (collective getters) -------------------------------------------------
def safe_get_full_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The parameter's full fp32 master value (None if frozen). Collective."""
    f, i = _locate(param)
    if not f.trainable:
        return None
    off, n, shape = _span(f, i)
    return gather_master(f, f.unit.state.comm)[off:off + n].view(shape).clone()


def safe_get_full_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The parameter's full fp32 gradient (the mean over ranks, as reduced), None
    if frozen or before backward. Collective. Inside engine.coalesce_grad_reduction(),
    once a backward there reached it: this rank's own gradient summed over the
    block so far, not yet reduced (no communication; DeepSpeed's local value)."""
    f, i = _locate(param)
    if not f.trainable:
        return None
    held = f.unit.state.held
    local = held.get(f) if held is not None else None
    if local is not None:
        off, n, shape = _span(f, i)
        return local[off:off + n].view(shape).clone()
    return _full(f, i, _grad(f))


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str
                                  ) -> Optional[torch.Tensor]:
    """The parameter's full optimizer state `optim_state_key` (e.g. "exp_avg"),
    None if frozen or absent. Collective."""
    f, i = _locate(param)
    return _full(f, i, _optimizer_state(f, optim_state_key)) if f.trainable else None


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the parameter's fp32 master value to the full `value` (the same on
    every rank; call it on every rank)."""
    f, i = _locate(param)
    master_shard.write_range(f, _full_span(f, i, value)[0], value)
    f.buffer.invalidate()


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the parameter's gradient to the full `value` (every rank, the same)."""
    f, i = _locate(param)
    if f.trainable:
        _write_full(f, i, _grad(f, create=True), value)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor,
                                  optim_state_key: str) -> None:
    """Set the parameter's optimizer state `optim_state_key` to the full `value`."""
    f, i = _locate(param)
    _write_full(f, i, _settable_state(f, optim_state_key), value)


def safe_update_full_grad_vectorized(param_list: list, update_func: Callable) -> None:
    """For each parameter, its full gradient becomes `update_func(old_full_grad,
    param)`. Collective (one gather per parameter)."""
    for p in param_list:
        old = safe_get_full_grad(p)
        if old is not None:
            safe_set_full_grad(p, update_func(old, p))


# ---- this rank's piece (no communication) ---------------------------------------------
def _local(f: FlatParam, i: Optional[int], shard: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if shard is None:
        return None
    a, b = _local_range(f, i)
    return shard.detach()[a:b].clone()


def _set_local(f: FlatParam, i: Optional[int], shard: torch.Tensor, value: torch.Tensor) -> None:
    a, b = _local_range(f, i)
    if value.numel() != b - a:
        raise ValueError(f"deepspeed.utils: a local value of {value.numel()} elements for a "
                         f"local piece of {b - a}")
    with torch.no_grad():
        shard[a:b] = value.detach().reshape(-1)


def safe_get_local_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    f, i = _locate(param)
    return _local(f, i, f.primary_shard) if f.trainable else None


def safe_get_local_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    f, i = _locate(param)
    return _local(f, i, _grad(f)) if f.trainable else None


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str
                                   ) -> Optional[torch.Tensor]:
    f, i = _locate(param)
    return _local(f, i, _optimizer_state(f, optim_state_key)) if f.trainable else None


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's piece of the fp32 master. Every rank must call it (the
    unit's copies are dropped everywhere, so routes stay equal)."""
    f, i = _locate(param)
    if f.int_storage:
        raise ValueError("deepspeed.utils.safe_set_local_fp32_param: this frozen parameter is "
                         "stored as INT8 (quantized_nontrainable_weights); set it whole with "
                         "safe_set_full_fp32_param")
    _set_local(f, i, f.primary_shard, value)
    f.buffer.invalidate()


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    f, i = _locate(param)
    if f.trainable:
        _set_local(f, i, _grad(f, create=True), value)


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor,
                                   optim_state_key: str) -> None:
    f, i = _locate(param)
    _set_local(f, i, _settable_state(f, optim_state_key), value)
