"""The codecs as compiled kernels: INT8 / INT4 blockwise quantize (with nibble packing and the
sender's dequantized copy) and dequantize, each one fused torch.compile kernel (inductor: C++ on
the CPU, Triton on a GPU), bitwise equal to quant.py's eager ops, which stay the fallback.
quant.py calls them on whole blocks and does the rest: the scales from the absmax a kernel
returns, and a non-finite block's codes.

[Note: what makes them equal]
The same fp32 arithmetic: max |x| is exact; values are divided by the scale absmax / qmax exactly
(inductor's C++ keeps the true division; a multiplication by the reciprocal would differ in the last
bit); rounding is half to even. The scale inside a kernel is fp32(fp64(absmax) * fp64(1 / qmax)),
not a division: it equals fp32(absmax / qmax) for every finite fp32 absmax and +inf, for qmax 127
and 7 (fp64 carries the quotient to within 2^-52 of itself, and a quotient of two fp32 numbers is
never within 2^-49 of a midpoint between fp32 numbers; checked over all 2^31 of them,
docs/notebook.md, and over a sample in tests/comm/test_kernels.py). A division there would sit
inside the loop over a block's values (the int8 stores may alias the absmax, so the compiler reloads
it and recomputes the scale at each step): 0.3 to 0.5 ms of a 3.5 ms kernel.
tests/comm/test_kernels.py checks them on the CPU over shapes, block sizes, dtypes, zero, subnormal
and non-finite blocks; `benchmarks/conformance/gpu_check.py` does on a GPU, where Triton compiles
them; until it has run on one, they run on a GPU only with ZEROPP_COMPILE=1.

[Note: one pass, pairs]
A quantize kernel is one loop over the blocks: each block's max |x|, then its codes while it is
in cache. Returning the scale (computed from the max) would split it into two passes over the
input, so the kernel returns the max and quant.py makes the scales (8K values for 64 MiB). INT4
packs elements 2i and 2i+1 into a byte: with fp32 values read (and the dequantized copy written)
as int64 pairs every access is contiguous and vectorized; a strided pair view ran scalar (INT4
quantize 4.8 ms against 2.8, dequantize 40 against 2.9, benchmarks/quant.py's tensor).

The block count is a dynamic dimension: one compile per variant (op, bits, dtypes, outputs) and
process, not per size (inductor's disk cache makes later processes' cheap). `ZEROPP_COMPILE=0`
turns the kernels off, as does a failed compile (for the process, with one warning).
"""

from __future__ import annotations

import os
import threading
import types
import warnings
from typing import Callable, Optional

import torch

_failed = False


# Per bit width, the size from which the kernels run: below it a call's fixed cost (dynamo's
# guards, quant.py's scales) exceeds what the kernel saves over the eager ops in cache-sized
# chunks (benchmarks/quant.py, "by size", 3 runs: INT8 0.87-0.93 of eager at 2M values, 1.04-1.09
# at 1M; INT4 0.83-1.18 at 256K, 0.56-0.78 at 1M). ZEROPP_COMPILE_MIN_NUMEL overrides both.
MIN_NUMEL = {8: 1 << 21, 4: 1 << 18}


def enabled(device: torch.device, numel: int, bits: int) -> bool:
    """Whether the compiled kernels take `numel` values at `bits` on `device` now: not while
    dynamo traces a caller (the eager ops are traced there); on a GPU only with
    ZEROPP_COMPILE=1, until gpu_check.py has shown Triton's bytes equal there (the note)."""
    if bits not in MIN_NUMEL:  # no kernel written for this width
        return False
    least = int(os.environ.get("ZEROPP_COMPILE_MIN_NUMEL", MIN_NUMEL[bits]))
    flag = os.environ.get("ZEROPP_COMPILE")
    return (numel >= least and flag != "0" and not _failed
            and (device.type == "cpu" or (device.type == "cuda" and flag == "1"))
            and not torch.compiler.is_compiling())


# Triton writes `/` as an approximate division and flushes subnormals unless told: eager's exact
# division and subnormal scales need both (no effect on the CPU). On the CPU, inductor's
# unsafe-math switch (an environment variable can set it) links in flush-to-zero, which then
# holds for every op of the thread, eager too; fp contraction would fuse multiply-adds. Both off.
_OPTIONS = {"eager_numerics.division_rounding": True, "eager_numerics.disable_ftz": True,
            "cpp.enable_unsafe_math_opt_flag": False,
            "cpp.enable_floating_point_contract_flag": "off"}


def _guarded(fn: Callable) -> Callable:
    try:  # a torch without one of the options refuses them here
        compiled, refused = torch.compile(fn, dynamic=True, options=_OPTIONS), None
    except Exception as e:
        compiled, refused = None, e

    def call(*args, **kwargs):
        global _failed
        try:
            if refused is not None:
                raise refused
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


def _divisor(absmax: torch.Tensor, qmax: int) -> torch.Tensor:
    """quant.block_scales' scale, to divide by: absmax / qmax (see the note), at least
    the smallest normal. An all-zero block's is that too (0 / it is 0, as 0 / 1 in the
    eager ops); a non-finite block's is non-finite, and quant.py overwrites its codes."""
    s = (absmax.double() * (1.0 / qmax)).float()
    # quant._TINY written out: a global float becomes an input of the compiled function,
    # loaded and converted at every step of the loop over a block (3.3 ms against 3.1)
    return torch.where(s < 2.0 ** -126, 2.0 ** -126, s)


def _dequantized(v: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    # the -0.0 rounding leaves becomes the +0.0 a code decodes to
    return torch.where(v == 0, 0.0, v) * d


def _halves(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs (_as_pairs) -> the even and the odd values in fp32: an int64 holds two fp32
    values, an int32 two bf16 ones (a bf16 is an fp32's upper half); little-endian."""
    if w.dtype == torch.int32:
        return (w << 16).view(torch.float32), (w & -65536).view(torch.float32)
    return w.to(torch.int32).view(torch.float32), (w >> 32).to(torch.int32).view(torch.float32)


def _pairs(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """fp32 even and odd values -> int64 pairs (the inverse of _halves for fp32)."""
    return ((even.view(torch.int32).to(torch.int64) & 0xFFFFFFFF)
            | (odd.view(torch.int32).to(torch.int64) << 32))


def _as_pairs(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """fp32 as int64, bf16 as int32: the view _halves reads. Made outside the compiled functions:
    one made inside is written back in a second pass (INT4 dequantize 39 ms instead of 2.9)."""
    return None if t is None else t.view(torch.int64 if t.dtype == torch.float32 else torch.int32)


def _pairable(*ts: Optional[torch.Tensor]) -> bool:
    """Whether these tensors can be read as pairs: fp32 or bf16, at even offsets."""
    return all(t is None or (t.dtype in (torch.float32, torch.bfloat16)
                             and t.storage_offset() % 2 == 0) for t in ts)


# Every tensor is 2-D, (blocks, values or bytes of a block): a flat view sliced to a
# dynamic length would cost index arithmetic per element (inductor's C++ then is scalar).
def _quantize(key: tuple) -> Callable:
    bits, pairs = key[1], key[-1]

    def kernel(x: torch.Tensor, data: torch.Tensor, deq: Optional[torch.Tensor],
               xp: Optional[torch.Tensor]) -> torch.Tensor:
        xf = x.float()
        absmax = xf.abs().amax(dim=1, keepdim=True)
        d = _divisor(absmax, 127 if bits == 8 else 7)
        if bits == 8:
            v = (xf / d).round()  # |q| <= qmax (+ an ulp), so it rounds into range
            data.copy_(v.to(torch.int8))
            if deq is not None:
                deq.copy_(_dequantized(v, d))
            return absmax
        # pairs: xp and deq are x and the fp32 output as pairs (the note); else strided, slower
        lo, hi = _halves(xp) if pairs else (xf[:, 0::2], xf[:, 1::2])
        v_lo, v_hi = (lo / d).round(), (hi / d).round()
        codes = (v_lo.to(torch.int32) + 8) | ((v_hi.to(torch.int32) + 8) << 4)
        data.copy_(codes.to(torch.uint8))
        if deq is not None and pairs:
            deq.copy_(_pairs(_dequantized(v_lo, d), _dequantized(v_hi, d)))
        elif deq is not None:
            deq[:, 0::2].copy_(_dequantized(v_lo, d))
            deq[:, 1::2].copy_(_dequantized(v_hi, d))
        return absmax
    return kernel


def _dequantize(key: tuple) -> Callable:
    bits = key[1]

    def kernel(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        if bits == 8:
            out.copy_(data.float() * scales)
        else:
            w = data.to(torch.int32)
            out.copy_(_pairs(((w & 15) - 8).float() * scales, ((w >> 4) - 8).float() * scales))
    return kernel


# One compiled function per variant, so that each sees one graph (and the 0/1-size
# specializations of its dynamic dimensions), far below dynamo's recompile limit.
_KERNELS: dict[tuple, Callable] = {}
_LOCK = threading.Lock()  # the reduce pipeline's two threads may ask at once


def _kernel(key: tuple) -> Callable:
    with _LOCK:
        if key not in _KERNELS:
            fn = (_quantize if key[0] == "q" else _dequantize)(key)
            # dynamo keeps its compiled graphs (and counts recompiles) per code object,
            # which closures share: give each variant its own.
            name = "_".join(map(str, key)).replace("torch.", "")
            code = fn.__code__.replace(co_name=f"zeropp_{name}")
            _KERNELS[key] = _guarded(types.FunctionType(code, fn.__globals__, code.co_name,
                                                        fn.__defaults__, fn.__closure__))
        return _KERNELS[key]


def quantize_into(x: torch.Tensor, data: torch.Tensor, bits: int,
                  deq: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """quant.quantize's work on whole blocks: `x` (blocks, block size, any float dtype);
    codes into `data` (blocks, bytes per block), `dequantize()` of them into `deq` (fp32,
    as `x`) if given. Returns each block's max |x| (blocks, 1), NaN propagated, for
    quant.py's scales and non-finite blocks; None if the kernels are off (eager then)."""
    pairs = bits == 4 and _pairable(x, deq)  # INT8's kernel reads no pairs
    key = ("q", bits, x.dtype, deq is None, *((pairs,) if bits == 4 else ()))
    args = (x, data, _as_pairs(deq), _as_pairs(x)) if pairs else (x, data, deq, None)
    try:
        return _kernel(key)(*args)
    except _Fallback:
        return None


def compiles_dequantize(bits: int, dtype: torch.dtype) -> bool:
    """Whether a dequantize at `bits` into `dtype` has a kernel. INT8 into fp32 stays eager: its
    two ops over cache-sized chunks beat the kernel at a unit's piece sizes (1M values: 60 us
    against 87), no slower on 64 MiB; into bf16 / fp16, and INT4 into fp32, the kernel is faster
    (4M values: 300 us against 530 and 1000). INT4 into 16-bit outputs: not written."""
    return (bits == 8 and dtype in (torch.bfloat16, torch.float16)
            or bits == 4 and dtype == torch.float32)


def dequantize_into(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                    bits: int) -> bool:
    """quant.dequantize's work on whole blocks: codes `data` (blocks, bytes per block) times
    `scales` (blocks, 1) into `out` (blocks, block size); False where no kernel takes them."""
    if not (compiles_dequantize(bits, out.dtype) and (bits == 8 or _pairable(out))):
        return False
    try:
        # the scales as their own tensor (4 bytes a block): an fp32 view of the uint8 wire
        # buffer as a compiled function's input or output tripped a dynamic-shapes assert
        _kernel(("dq", bits, out.dtype))(data, scales.clone(), out if bits == 8 else _as_pairs(out))
    except _Fallback:
        return False
    return True
