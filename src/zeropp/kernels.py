"""The codecs as compiled kernels: INT8 / INT4 blockwise quantize (nearest or
stochastic rounding, nibble packing, the dequantized copy a sender keeps) as one
fused kernel from torch.compile (inductor: C++ on the CPU, Triton on a GPU),
bitwise equal to quant.py's eager ops, which stay the fallback. Dequantize stays
eager: compiled, it ran no faster here (INT8 into a preallocated output: 5.1 ms
against eager's 2.9 for 16M values; INT4's unpacking 6.9 against 6.5, three
formulations tried; benchmarks/quant.py).

[Note: what makes them equal]
The same fp32 arithmetic in the same order: max and min are exact, the scale is a
true division absmax / qmax, the values a true division by it (inductor's C++ keeps
both divisions; a multiplication by the reciprocal would differ in the last bit),
rounding is round-half-even (`round`) or floor after adding the same uniform draw;
those draws are made eagerly, chunk by chunk as the eager path makes them, so one
generator gives the same bits either way. Checked on the CPU over shapes, block
sizes, dtypes, zero, subnormal and non-finite blocks (tests/test_kernels.py); on a
GPU, where Triton compiles the kernel (told to divide exactly and keep subnormals),
`benchmarks/conformance/gpu_check.py` checks the same; until it has run on one, the
kernels run on a GPU only with ZEROPP_COMPILE=1.

The blocks' count is a dynamic dimension: one compile per variant (bits, rounding,
input dtype, whether a dequantized copy is kept), not per tensor size, paid once per
process (inductor's on-disk cache makes later processes' compiles cheap).
`ZEROPP_COMPILE=0` turns them off; a compile that fails turns them off for the
process, with one warning.
"""

from __future__ import annotations

import math
import os
import threading
import types
import warnings
from typing import Callable, Optional

import torch

_TINY = torch.finfo(torch.float32).smallest_normal
_failed = False


# Below this many values a call's fixed cost (dynamo's guards, the wrapper) is more
# than the kernel saves over the eager ops (benchmarks/quant.py, "by size");
# ZEROPP_COMPILE_MIN_NUMEL overrides it.
MIN_NUMEL = 1 << 18


def enabled(device: torch.device, numel: int) -> bool:
    """Whether the compiled kernels take `numel` values on `device` now (not while
    dynamo traces a caller: inside a compiled region the eager ops are traced). On
    the CPU by default; on a GPU only with ZEROPP_COMPILE=1 set, until gpu_check.py
    has shown Triton's bytes equal to the eager ones there (see the note)."""
    least = int(os.environ.get("ZEROPP_COMPILE_MIN_NUMEL", MIN_NUMEL))
    flag = os.environ.get("ZEROPP_COMPILE")
    return (numel >= least and flag != "0" and not _failed
            and (device.type == "cpu" or (device.type == "cuda" and flag == "1"))
            and not torch.compiler.is_compiling())


# Triton writes `/` as an approximate division and flushes subnormals unless told:
# eager's exact division and subnormal scales need both (no effect on the CPU).
_OPTIONS = {"eager_numerics.division_rounding": True, "eager_numerics.disable_ftz": True}


def _guarded(fn: Callable) -> Callable:
    compiled = torch.compile(fn, dynamic=True, options=_OPTIONS)

    def call(*args, **kwargs):
        global _failed
        try:
            return compiled(*args, **kwargs)
        except torch.cuda.OutOfMemoryError:
            raise  # the eager ops would need the memory too
        except Exception as e:  # no compiler here, or an inductor bug: eager from now on
            _failed = True
            warnings.warn(f"zeropp: compiled codecs unavailable ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); using the eager "
                          "ones (ZEROPP_COMPILE=0 silences this)", stacklevel=3)
            raise _Fallback from e
    return call


class _Fallback(Exception):
    """Raised once by a failed compile: the caller runs the eager op instead."""


def _round_rows(xb: torch.Tensor, noise: Optional[torch.Tensor], qmax: int):
    """quant.round_blocks, as one expression."""
    absmax = torch.maximum(xb.amax(dim=1), xb.amin(dim=1).neg())
    # +0 and the quiet NaN, as quant.absmax_rows
    absmax = torch.where(absmax == 0, 0.0, torch.where(absmax.isnan(), math.nan, absmax))
    s = absmax / qmax
    s = torch.where((s < _TINY) & (absmax > 0), _TINY, s)
    v = xb / torch.where(s > 0, s, 1.0).unsqueeze(1)
    if noise is None:
        v = v.round()
    else:
        v = (v + noise).floor().clamp(-qmax, qmax)
    return s, torch.where(s.isfinite().unsqueeze(1), v, 0.0)


# Every tensor is 2-D, (blocks, values of a block): a flat view sliced to a dynamic
# length would cost index arithmetic per element (inductor's C++ then is scalar).
def _quantizer(bits: int) -> Callable:
    qmax = {8: 127, 4: 7}[bits]

    def kernel(x: torch.Tensor, data: torch.Tensor, noise: Optional[torch.Tensor],
               deq: Optional[torch.Tensor]) -> torch.Tensor:
        s, v = _round_rows(x.float(), noise, qmax)
        if bits == 8:
            data.copy_(v.to(torch.int8))
        else:  # element 2i in the low nibble, 2i+1 in the high one, offset by 8
            pairs = v.view(v.shape[0], -1, 2).to(torch.int32) + 8
            data.copy_((pairs[:, :, 0] | (pairs[:, :, 1] << 4)).to(torch.uint8))
        if deq is not None:  # the -0.0 rounding leaves becomes the +0.0 a code decodes to
            deq.copy_(torch.where(v == 0, 0.0, v) * s.unsqueeze(1))
        return s
    return kernel


# One compiled function per variant, so that each sees one graph (and the 0/1-size
# specializations of its dynamic dimensions), far below dynamo's recompile limit.
_KERNELS: dict[tuple, Callable] = {}


_LOCK = threading.Lock()  # the reduce pipeline's two threads may ask at once


def _kernel(key: tuple, make: Callable) -> Callable:
    with _LOCK:
        return _KERNELS[key] if key in _KERNELS else _make(key, make)


def _make(key: tuple, make: Callable) -> Callable:
    fn = make(key[1])
    # dynamo keeps its compiled graphs (and counts recompiles) per code object, which
    # closures share: give each variant its own.
    name = "_".join(map(str, key)).replace("torch.", "")
    code = fn.__code__.replace(co_name=f"zeropp_{name}")
    _KERNELS[key] = _guarded(types.FunctionType(code, fn.__globals__, code.co_name,
                                                fn.__defaults__, fn.__closure__))
    return _KERNELS[key]


def quantize_into(x: torch.Tensor, scales: torch.Tensor, data: torch.Tensor, bits: int,
                  noise: Optional[torch.Tensor], deq: Optional[torch.Tensor]) -> bool:
    """quant.quantize's work on whole blocks: `x` (blocks, block size) in its own
    float dtype; codes into `data` (blocks, bytes per block), scales into `scales`,
    `dequantize()` of them into `deq` (fp32, as `x`) if given; False if the kernels
    are off (the caller then runs the eager ops). The kernel returns the scales and
    they are copied here: a float view of the uint8 wire buffer as a compiled
    function's input defeats dynamic shapes (an internal assert); a view of the
    same width (`data`) does not."""
    try:
        key = ("q", bits, x.dtype, noise is None, deq is None)
        scales.copy_(_kernel(key, _quantizer)(x, data, noise, deq))
    except _Fallback:
        return False
    return True
