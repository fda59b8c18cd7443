"""The compiled codecs (zeropp/kernels.py) write the eager ops' bytes, bit for bit:
the wire buffer (scales and codes), the sender's dequantized copy, and what
`dequantize` makes of them in fp32, bf16 and fp16, for INT8 and INT4 (rounding to
nearest), whole and padded last blocks, fp32 / bf16 / fp16 inputs, odd offsets,
several chunks, and all-zero, subnormal, -0.0 and non-finite blocks
(tests/codec_cases.py, which gpu_check.py runs on a GPU);
ZEROPP_COMPILE=0 turns them off; a failed compile falls back to them."""

from __future__ import annotations

import codec_cases  # (tests/codec_cases.py, shared with benchmarks/conformance/gpu_check.py)
import pytest
import torch
from cases import fit, random_batches

from zeropp import kernels, quant


@pytest.fixture(autouse=True)
def every_size(monkeypatch):
    monkeypatch.setattr(kernels, "MIN_NUMEL", {8: 0, 4: 0})  # every size here
    monkeypatch.setenv("ZEROPP_COMPILE", "1")


@pytest.mark.parametrize("bits", [8, 4])
def test_compiled_codecs_write_the_eager_bytes(monkeypatch, bits):
    """codec_cases.CASES: the wire, the sender's dequantized copy, dequantize() into
    fp32 / bf16 / fp16, and a quantize without the copy."""
    monkeypatch.setattr(kernels, "_KERNELS", {})  # what ran here, below
    assert codec_cases.mismatches(bits) == []
    assert not kernels._failed
    ran = codec_cases.ran(bits)
    assert {("q", bits), ("dq", bits)} <= {k[:2] for k in ran}, "no kernel ran"
    assert {k[3] for k in ran if k[0] == "q"} == {True, False}  # with and without the copy
    assert ("dq", 8, torch.float32) not in ran  # kernels.compiles_dequantize: eager
    if bits == 4:  # both INT4 quantize paths: pairs and strided (odd offset, fp16)
        assert {k[-1] for k in ran if k[:2] == ("q", 4)} == {True, False}


def test_a_failed_compile_falls_back_to_the_eager_bytes_with_one_warning(monkeypatch):
    """As on a torch that refuses one of the inductor options: the eager ops' bytes,
    one warning, the kernels off for the process."""
    monkeypatch.setattr(kernels, "_KERNELS", {})
    monkeypatch.setattr(kernels, "_failed", False)
    monkeypatch.setattr(kernels, "_OPTIONS", {**kernels._OPTIONS, "no.such_option": 1})
    x = codec_cases.special_input(6 * 64, 64, torch.float32)
    monkeypatch.setenv("ZEROPP_COMPILE", "0")
    eager = quant.quantize(x, 8, 64).to_bytes().clone()
    monkeypatch.setenv("ZEROPP_COMPILE", "1")
    with pytest.warns(UserWarning, match="compiled codecs unavailable") as seen:
        first = quant.quantize(x, 8, 64).to_bytes().clone()
        second = quant.quantize(x, 8, 64).to_bytes().clone()
    assert len([w for w in seen if "compiled codecs" in str(w.message)]) == 1
    assert kernels._failed and torch.equal(first, eager) and torch.equal(second, eager)


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
        losses = fit(m, opt, random_batches(3, 256, (2, 32), dist.get_rank()),
                     clip_fn=zeropp.clip_grad_norm_)
        out[mode] = (losses, [p.detach().clone() for p in m.parameters()])
    out["kernels"] = [] if kernels._failed else sorted(str(k) for k in kernels._KERNELS)
    return out


def test_training_with_the_compiled_codecs_is_bitwise_the_eager_training():
    """zeropp-plus at W=4 as 2x2: the same losses and master shards on every rank."""
    from zeropp.cli.launch import spawn
    for r in spawn(_train, 4, 2, args=("zeropp-plus",), timeout=400):
        assert r["eager"][0] == r["compiled"][0]
        assert all(torch.equal(a, b) for a, b in zip(r["eager"][1], r["compiled"][1]))
        assert r["kernels"], "no compiled kernel ran (or its compile failed)"
