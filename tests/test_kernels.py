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
    monkeypatch.setattr(kernels, "MIN_NUMEL", {8: 0, 4: 0})  # every size here
    monkeypatch.setenv("ZEROPP_COMPILE", "1")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _round_trip(x, bits, block, stochastic, out_dtype):
    g = torch.Generator().manual_seed(1)
    deq = torch.empty(x.numel())
    q = quant.quantize(x, bits, block, stochastic=stochastic, generator=g, dequantized=deq)
    out = quant.dequantize(q, out=torch.empty(x.numel(), dtype=out_dtype))
    return q.to_bytes().clone(), _bits(deq), _bits(out), g.get_state()


def _input(n: int, block: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """Gaussian values with an all-zero block, a subnormal one, and a block holding
    a NaN and one an Inf (when there are blocks enough); `offset` values into its
    storage (an odd one: not readable as pairs, the INT4 kernels' strided path)."""
    x = torch.randn(offset + n, generator=torch.Generator().manual_seed(n)) * 3
    x = x[offset:]
    if n >= 5 * block:
        x[:block] = 0
        x[block:2 * block] *= 1e-40
        x[2 * block + 3] = float("nan")
        x[3 * block + 1] = float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("bits,stochastic", list(itertools.product([8, 4], [False, True])))
def test_compiled_codecs_write_the_eager_bytes(monkeypatch, bits, stochastic):
    monkeypatch.setattr(kernels, "_KERNELS", {})  # what ran here, below
    for n, block, dtype, out_dtype, offset in [
            (5 * 64 + 10, 64, torch.float32, torch.float32, 0),
            (6 * 2048, 2048, torch.float32, torch.bfloat16, 0),
            (5 * 256 + 2, 256, torch.bfloat16, torch.float32, 0),
            (4096, 2, torch.float16, torch.float32, 0),
            (5 * 128, 128, torch.float32, torch.float32, 1),
            (7, 2048, torch.float32, torch.float32, 0)]:
        x = _input(n, block, dtype, offset)
        monkeypatch.setenv("ZEROPP_COMPILE", "0")
        eager = _round_trip(x, bits, block, stochastic, out_dtype)
        monkeypatch.setenv("ZEROPP_COMPILE", "1")
        compiled = _round_trip(x, bits, block, stochastic, out_dtype)
        for what, a, b in zip(("wire", "dequantized", "dequantize", "generator"), eager,
                              compiled):
            assert torch.equal(a, b), (what, n, block, dtype, out_dtype)
    assert not kernels._failed
    ran = set(kernels._KERNELS)
    assert {("q", bits), ("dq", bits)} <= {k[:2] for k in ran}, "no kernel ran"
    if bits == 4:  # both INT4 quantize paths: pairs and strided (odd offset, fp16)
        assert {k[-1] for k in ran if k[:2] == ("q", 4)} == {True, False}


@pytest.mark.parametrize("qmax", [127, 7])
def test_the_kernels_scale_equals_a_true_division(qmax):
    """kernels._divisor's fp32(fp64(a) * fp64(1 / qmax)) is fp32(a / qmax) (its
    note): here on every 251st fp32 bit pattern from 0 to +inf (8.5M values); the
    notebook records all 2^31."""
    a = torch.arange(0, 0x7F800001, 251, dtype=torch.int32).view(torch.float32)
    mul = (a.double() * (1.0 / qmax)).float()
    assert torch.equal(mul.view(torch.int32), (a / qmax).view(torch.int32))


def test_zeropp_compile_0_runs_no_kernel(monkeypatch):
    monkeypatch.setenv("ZEROPP_COMPILE", "0")
    monkeypatch.setattr(kernels, "_KERNELS", {})
    quant.dequantize(quant.quantize(torch.randn(3 * 64), 8, 64))
    assert kernels._KERNELS == {}


def _train(preset: str) -> dict:
    """3 AdamW steps of a small GPT with the eager codecs, then again with the
    compiled ones taking every size (on the reduce pipeline's threads too)."""
    import os

    import torch.distributed as dist

    import zeropp
    from zeropp.train.model import GPT, GPTConfig
    torch.set_num_threads(1)
    out = {}
    for mode, env in (("eager", {"ZEROPP_COMPILE": "0"}),
                      ("compiled", {"ZEROPP_COMPILE": "1", "ZEROPP_COMPILE_MIN_NUMEL": "0"})):
        os.environ.update(env)
        torch.manual_seed(0)
        m = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_embd=64, n_head=2))
        zeropp.shard(m, zeropp.Config.preset(preset, node_size=2))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(dist.get_rank())
        losses = []
        for _ in range(3):
            x = torch.randint(0, 256, (2, 32), generator=g)
            loss = m(x, x)[1]
            loss.backward()
            zeropp.clip_grad_norm_(m, 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[mode] = (losses, [p.detach().clone() for p in m.parameters()])
    out["kernels"] = [] if kernels._failed else sorted(str(k) for k in kernels._KERNELS)
    return out


def test_training_with_the_compiled_codecs_is_bitwise_the_eager_training():
    """zeropp-plus at W=4 as 2x2: the same losses and master shards on every rank."""
    from zeropp.launch import spawn
    for r in spawn(_train, 4, 2, args=("zeropp-plus",), timeout=400):
        assert r["eager"][0] == r["compiled"][0]
        assert all(torch.equal(a, b) for a, b in zip(r["eager"][1], r["compiled"][1]))
        assert r["kernels"], "no compiled kernel ran (or its compile failed)"
