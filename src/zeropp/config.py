"""Config: every knob of zeropp in one frozen, validated dataclass.

Names follow DeepSpeed's ZeRO++ keys where one exists (`zero_quantized_weights`
-> `quantized_weights`, ...), so a DeepSpeed user finds each switch at once.
A bad value raises `ValueError` naming the field, the value and what is allowed,
at construction time rather than deep inside a collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BITS = (4, 8)


@dataclass(frozen=True)
class Config:
    quantized_weights: bool = False
    """qwZ: all-gather weights as blockwise INT8 (DeepSpeed `zero_quantized_weights`)."""
    hpz_partition_size: int = 1
    """hpZ: secondary-partition group size; 1 = off (DeepSpeed `zero_hpz_partition_size`)."""
    quantized_gradients: bool = False
    """qgZ: hierarchical all-to-all INT4 gradient reduce-scatter (`zero_quantized_gradients`)."""
    quantized_nontrainable_weights: bool = False
    """Keep frozen parameters stored as INT8 (`zero_quantized_nontrainable_weights`)."""
    node_size: Optional[int] = None
    """Ranks per node; None reads LOCAL_WORLD_SIZE (torchrun sets it), else one node."""
    param_dtype: Optional[torch.dtype] = None
    """Compute dtype of gathered weights; None keeps each parameter's own dtype."""
    reduce_dtype: torch.dtype = torch.float32
    """Dtype gradients are summed in across ranks."""
    weight_bits: int = 8
    grad_bits: int = 4
    block_size: int = 2048
    """Elements per quantization block (one fp32 scale each)."""
    prefetch: bool = True
    """Issue the next unit's gather asynchronously ahead of its use."""

    def __post_init__(self) -> None:
        for name in ("quantized_weights", "quantized_gradients",
                     "quantized_nontrainable_weights", "prefetch"):
            _check(name, getattr(self, name), isinstance(getattr(self, name), bool),
                   "True or False")
        _check_int("hpz_partition_size", self.hpz_partition_size, 1, "an integer >= 1")
        if self.node_size is not None:
            _check_int("node_size", self.node_size, 1, "None or an integer >= 1")
        if self.param_dtype is not None:
            _check("param_dtype", self.param_dtype, self.param_dtype in _FLOAT_DTYPES,
                   "None, torch.float32, torch.bfloat16 or torch.float16")
        _check("reduce_dtype", self.reduce_dtype, self.reduce_dtype in _FLOAT_DTYPES,
               "torch.float32, torch.bfloat16 or torch.float16")
        for name in ("weight_bits", "grad_bits"):
            v = getattr(self, name)
            _check(name, v, _is_int(v) and v in _BITS, "4 or 8")
        _check("block_size", self.block_size,
               _is_int(self.block_size) and 2 <= self.block_size <= 1 << 20
               and self.block_size % 2 == 0,
               "an even integer in [2, 1048576] (INT4 packs two values per byte)")

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(name: str, value, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"zeropp.Config: {name}={value!r} is invalid; allowed: {allowed}")


def _check_int(name: str, value, minimum: int, allowed: str) -> None:
    _check(name, value, _is_int(value) and value >= minimum, allowed)
