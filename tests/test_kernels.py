"""The compiled codecs (zeropp/kernels.py) write the eager ops' bytes, bit for bit:
the wire buffer (scales and codes), the sender's dequantized copy, and what
`dequantize` makes of them in fp32 and bf16, for INT8 and INT4, nearest and stochastic rounding (the same
generator gives the same draws), whole and padded last blocks, fp32 / bf16 / fp16
inputs, and all-zero, subnormal and non-finite blocks; ZEROPP_COMPILE=0 turns them
off."""

from __future__ import annotations

import itertools

import pytest
import torch

from zeropp import kernels, quant


@pytest.fixture(autouse=True)
def every_size(monkeypatch):
    monkeypatch.setattr(kernels, "MIN_NUMEL", 0)  # the kernels take every size here
    monkeypatch.setenv("ZEROPP_COMPILE", "1")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _round_trip(x, bits, block, stochastic, out_dtype):
    g = torch.Generator().manual_seed(1)
    deq = torch.empty(x.numel())
    q = quant.quantize(x, bits, block, stochastic=stochastic, generator=g, dequantized=deq)
    out = quant.dequantize(q, out=torch.empty(x.numel(), dtype=out_dtype))
    return q.to_bytes().clone(), _bits(deq), _bits(out), g.get_state()


def _input(n: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Gaussian values with an all-zero block, a subnormal one, and a block holding
    a NaN and one an Inf (when there are blocks enough)."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    if n >= 5 * block:
        x[:block] = 0
        x[block:2 * block] *= 1e-40
        x[2 * block + 3] = float("nan")
        x[3 * block + 1] = float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("bits,stochastic", list(itertools.product([8, 4], [False, True])))
def test_compiled_codecs_write_the_eager_bytes(monkeypatch, bits, stochastic):
    for n, block, dtype, out_dtype in [(5 * 64 + 10, 64, torch.float32, torch.float32),
                                       (6 * 2048, 2048, torch.float32, torch.bfloat16),
                                       (5 * 256 + 2, 256, torch.bfloat16, torch.float32),
                                       (4096, 2, torch.float16, torch.float32),
                                       (7, 2048, torch.float32, torch.float32)]:
        x = _input(n, block, dtype)
        monkeypatch.setenv("ZEROPP_COMPILE", "0")
        eager = _round_trip(x, bits, block, stochastic, out_dtype)
        monkeypatch.setenv("ZEROPP_COMPILE", "1")
        compiled = _round_trip(x, bits, block, stochastic, out_dtype)
        for what, a, b in zip(("wire", "dequantized", "dequantize", "generator"), eager,
                              compiled):
            assert torch.equal(a, b), (what, n, block, dtype, out_dtype)
    assert not kernels._failed
    assert any(k[:2] == ("q", bits) for k in kernels._KERNELS), "no kernel ran"


def test_zeropp_compile_0_runs_no_kernel(monkeypatch):
    monkeypatch.setenv("ZEROPP_COMPILE", "0")
    monkeypatch.setattr(kernels, "_KERNELS", {})
    quant.dequantize(quant.quantize(torch.randn(3 * 64), 8, 64))
    assert kernels._KERNELS == {}
