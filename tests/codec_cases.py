"""The inputs on which the compiled codecs (zeropp/kernels.py) must write the eager
ops' bytes, shared by tests/comm/test_kernels.py (CPU) and gpu_check.py (a GPU, where
Triton compiles them): an all-zero block, a subnormal one, a NaN, an Inf, a -0.0
block and a NaN with a payload, over fp32 / bf16 / fp16 inputs, block sizes 2 to
2048, an odd storage offset (INT4's strided path), a padded last block, and one case
cut into chunks of 4 blocks."""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from zeropp import kernels, quant

# n, block, input dtype, dequantize's output dtype, storage offset, chunk bytes
CASES = [(7 * 64 + 10, 64, torch.float32, torch.float32, 0, 4 * 64 * 4),
         (6 * 2048, 2048, torch.float32, torch.bfloat16, 0, None),
         (7 * 256 + 2, 256, torch.bfloat16, torch.float16, 0, None),
         (4096, 2, torch.float16, torch.float32, 0, None),
         (7 * 128, 128, torch.float32, torch.float32, 1, None),
         (7, 2048, torch.float32, torch.float32, 0, None)]


def special_input(n: int, block: int, dtype: torch.dtype, offset: int = 0,
                  device: str = "cpu") -> torch.Tensor:
    """Gaussian values with the special blocks (when there are blocks enough),
    `offset` values into its storage."""
    x = torch.randn(offset + n, generator=torch.Generator().manual_seed(n)) * 3
    x = x[offset:]
    if n >= 6 * block:
        x[:block] = 0
        x[block:2 * block] *= 1e-40
        x[2 * block + 3] = float("nan")
        x[3 * block + 1] = float("inf")
        x[4 * block:5 * block] = -0.0
        x[5 * block + 1:5 * block + 2].view(torch.int32).fill_(-0x5fffff)  # 0xffa00001
    return x.to(dtype).to(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def round_trip(x: torch.Tensor, bits: int, block: int, out_dtype: torch.dtype,
               plain: bool) -> list:
    """The wire, the sender's dequantized copy, dequantize() of the wire; `plain`:
    also the wire of a quantize without the copy."""
    deq = torch.empty(x.numel(), device=x.device)
    q = quant.quantize(x, bits, block, dequantized=deq)
    out = quant.dequantize(q, out=torch.empty(x.numel(), dtype=out_dtype, device=x.device))
    got = [q.to_bytes().clone(), _bits(deq), _bits(out)]
    if plain:
        got.append(quant.quantize(x, bits, block).to_bytes().clone())
    return got


@contextlib.contextmanager
def compiled(on: bool):
    """The compiled codecs on at every size (on) or off (ZEROPP_COMPILE=0); the caller's
    setting and sizes back after."""
    saved = kernels.MIN_NUMEL, os.environ.get("ZEROPP_COMPILE")
    kernels.MIN_NUMEL = {8: 0, 4: 0}
    os.environ["ZEROPP_COMPILE"] = "1" if on else "0"
    try:
        yield
    finally:
        kernels.MIN_NUMEL = saved[0]
        os.environ.pop("ZEROPP_COMPILE", None)
        if saved[1] is not None:
            os.environ["ZEROPP_COMPILE"] = saved[1]


def mismatches(bits: int, *, device: str = "cpu",
               cases: Optional[list] = None) -> list[str]:
    """`cases` (default: all) eager and compiled at every size: what differs."""
    bad: list[str] = []
    chunk_bytes = quant.CHUNK_BYTES
    try:
        for n, block, dtype, out_dtype, offset, chunk in CASES if cases is None else cases:
            x = special_input(n, block, dtype, offset, device)
            quant.CHUNK_BYTES = chunk or chunk_bytes
            got = []
            for on in (False, True):
                with compiled(on):
                    got.append(round_trip(x, bits, block, out_dtype, dtype == torch.float32))
            for what, a, b in zip(("wire", "dequantized", "dequantize", "plain wire"), *got):
                if not torch.equal(a.cpu(), b.cpu()):
                    bad.append(f"{what} (n={n}, block={block}, {dtype} -> {out_dtype}, "
                               f"offset {offset})")
    finally:
        quant.CHUNK_BYTES = chunk_bytes
    return bad


def ran(bits: int) -> set:
    """The kernel variants at `bits` compiled so far (kernels._KERNELS' keys)."""
    return {k for k in kernels._KERNELS if k[1] == bits}
