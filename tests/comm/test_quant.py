"""zeropp.quant: error bounds, exactness, wire format, edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zeropp.quant import QTensor, dequantize, pack_int4, quantize, unpack_int4

QMAX = {8: 127, 4: 7}
EPS32 = 2.0 ** -23
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _elementwise_scale(q: QTensor) -> torch.Tensor:
    return q.scales.repeat_interleave(q.block_size)[:q.numel].view(q.shape)


def _tensor(draw, max_numel=600):
    shape = draw(st.lists(st.integers(1, 12), min_size=1, max_size=3))
    shape = shape if math.prod(shape) <= max_numel else [max_numel]
    seed = draw(st.integers(0, 2**31 - 1))
    log_scale = draw(st.floats(-20, 20))
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * math.exp(log_scale)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype)


@st.composite
def cases(draw):
    return (_tensor(draw), draw(st.sampled_from([8, 4])),
            draw(st.sampled_from([2, 4, 6, 8, 30, 64, 100, 256, 2048])))


@settings(max_examples=300, deadline=None)
@given(cases())
def test_round_to_nearest_error_is_at_most_half_a_step(case):
    """|x - dq(q(x))| <= scale/2 elementwise, plus fp32 rounding of x/scale and
    of the product (a few ulps of |x| and of qmax*scale)."""
    x, bits, block = case
    q = quantize(x, bits, block)
    err = (x.float() - dequantize(q, torch.float32)).abs()
    s = _elementwise_scale(q)
    bound = s / 2 + 4 * EPS32 * (x.float().abs() + QMAX[bits] * s)
    assert bool((err <= bound).all()), (err - bound).max()
    assert q.data.numel() == -(-x.numel() // block) * block * bits // 8


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([8, 4]), st.sampled_from([2, 8, 64, 256]), st.integers(1, 6),
       st.integers(-30, 30), st.integers(0, 10_000))
def test_values_on_the_grid_come_back_exactly(bits, block, nblocks, exp, seed):
    qmax = QMAX[bits]
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(-qmax, qmax + 1, (nblocks, block), generator=g)
    k[:, 0] = qmax  # every block spans the full range, so scale = 2**exp exactly
    x = (k.float() * 2.0 ** exp).view(-1)
    assert torch.equal(dequantize(quantize(x, bits, block)), x)


def test_int4_pack_unpack_is_a_bijection_on_all_256_bytes():
    b = torch.arange(256, dtype=torch.uint8)
    v = unpack_int4(b)
    assert v.min() == -8 and v.max() == 7 and v.numel() == 512
    kept = v.clone()
    assert torch.equal(pack_int4(v), b)
    assert torch.equal(v, kept)  # an int8 input is packed from a copy, not offset in place
    assert torch.equal(pack_int4(v.float()), b)  # what quantize passes: rounded fp32
    assert len({(int(v[2 * i]), int(v[2 * i + 1])) for i in range(256)}) == 256


def test_int4_nibble_order_is_low_nibble_first():
    assert pack_int4(torch.tensor([1, -2], dtype=torch.int8)).item() == (1 + 8) | ((-2 + 8) << 4)


@settings(max_examples=100, deadline=None)
@given(cases(), st.integers(0, 3))
def test_to_bytes_from_bytes_round_trips_at_any_offset(case, offset):
    x, bits, block = case
    q = quantize(x, bits, block)
    wire = q.to_bytes()
    assert wire.dtype == torch.uint8
    assert wire.numel() == QTensor.wire_bytes(x.numel(), bits, block)
    assert wire.numel() == q.payload_bytes + q.scale_bytes
    buf = torch.zeros(wire.numel() + offset, dtype=torch.uint8)
    buf[offset:] = wire  # e.g. one rank's piece of a gathered buffer
    r = QTensor.from_bytes(buf[offset:], x.shape, x.dtype, bits, block)
    assert torch.equal(dequantize(r), dequantize(q))


def test_from_bytes_rejects_a_wrong_length():
    with pytest.raises(ValueError, match="expected 68 uint8 bytes"):
        QTensor.from_bytes(torch.zeros(10, dtype=torch.uint8), (64,), torch.float32, 8, 64)


@pytest.mark.parametrize("bits", [8, 4])
def test_all_zeros_have_scale_zero_and_come_back_exact(bits):
    q = quantize(torch.zeros(300), bits, 64)
    assert torch.equal(q.scales, torch.zeros(5))
    assert torch.equal(dequantize(q), torch.zeros(300))


@pytest.mark.parametrize("bits", [8, 4])
def test_one_element_and_ragged_last_block(bits):
    assert dequantize(quantize(torch.tensor([-3.5]), bits, 64)).item() == -3.5
    x = torch.randn(130)
    q = quantize(x, bits, 64)  # 3 blocks, the last holding 2 values
    assert q.scales.numel() == 3 and dequantize(q).shape == (130,)
    assert (x - dequantize(q)).abs().max() <= q.scales.max() / 2 * (1 + 1e-6)


def test_huge_dynamic_range_in_one_tensor():
    x = torch.tensor([1e-30, -1e30, 1e-30, 2e-30])
    q = quantize(x, 8, 2)
    y = dequantize(q)
    assert y[1] == -1e30 and y[0] == 0  # one block: the small value is below a step
    # the second block has its own scale: 1e-30 sits exactly half a step off the grid
    s = q.scales[1].item()
    assert (y[2:] - x[2:]).abs().max() <= s / 2 + 4 * EPS32 * 127 * s
    assert bool(torch.isfinite(q.scales).all())


def test_subnormals_stay_within_half_a_step():
    x = torch.tensor([1e-40, -3e-41, 1e-44, 0.0, 1.4e-45, 0.0])
    for bits in (8, 4):
        q = quantize(x, bits, 2)
        assert bool((q.scales[:3] > 0).all())  # no non-zero block rounded to scale 0
        err = (x - dequantize(q)).abs()
        assert bool((err <= _elementwise_scale(q) / 2 + 1.5e-45).all())


def test_a_block_below_the_normal_range_keeps_its_codes_in_range_and_signs():
    """absmax / 127 subnormal: fp32 rounds it coarsely (134 * 2^-149 / 127 is 2^-149),
    so x / scale was 134 and wrapped to -122 in int8, a sign flip. The scale is now
    at least the smallest normal fp32: codes within [-127, 127], no sign flips."""
    tiny = 2.0 ** -149
    x = torch.tensor([134 * tiny, -90 * tiny, 3 * tiny, 0.0, 127 * tiny, -134 * tiny, 0.0, 1e-30])
    for bits in (8, 4):
        q = quantize(x, bits, 2)
        codes = dequantize(q) / _elementwise_scale(q)
        assert bool((codes.abs() <= {8: 127, 4: 7}[bits]).all())
        assert bool((torch.sign(dequantize(q)) * torch.sign(x) >= 0).all())
        assert bool((q.scales[:3] >= torch.finfo(torch.float32).smallest_normal).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_come_back_in_their_dtype(dtype):
    x = torch.randn(500).to(dtype)
    q = quantize(x, 8, 64)
    y = dequantize(q)
    assert y.dtype == dtype
    step = _elementwise_scale(q)
    assert bool(((x.float() - y.float()).abs() <= step / 2 + x.float().abs() * 2 ** -7).all())


@pytest.mark.parametrize("default", [torch.bfloat16, torch.float16])
def test_dequantize_computes_in_fp32_under_a_16_bit_default_dtype(default):
    """A padded last block goes through a scratch buffer: fp32 whatever the default dtype
    (under fp16's, 34 of these 100 values came back inf, the rest up to 15.9 off)."""
    x = torch.linspace(-1e5, 1e5, 100)
    q = quantize(x, 8, 64)
    want = dequantize(q)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        got = dequantize(q)
    finally:
        torch.set_default_dtype(saved)
    assert torch.equal(got, want)


def test_empty_tensor():
    q = quantize(torch.zeros(0, 5), 4, 64)
    assert q.scales.numel() == 0 and dequantize(q).shape == (0, 5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_flags_its_block_and_never_returns_finite_garbage(bad):
    x = torch.randn(256)
    x[70] = bad
    q = quantize(x, 8, 64)
    assert not bool(torch.isfinite(q.scales[1])) and bool(torch.isfinite(q.scales[[0, 2, 3]]).all())
    y = dequantize(q)
    assert not bool(torch.isfinite(y[64:128]).all())
    ok = torch.cat([x[:64], x[128:]])
    assert (ok - torch.cat([y[:64], y[128:]])).abs().max() <= q.scales[0:1].max() + 1
    assert bool(torch.isfinite(quantize(torch.randn(256), 8, 64).scales).all())


@settings(max_examples=200, deadline=None)
@given(cases())
def test_quantize_hands_back_bit_for_bit_what_dequantize_gives(case):
    """`dequantized=`: the values a receiver decodes, as the sender computes them
    from its rounded values (error feedback, qWD's owner), every bit equal."""
    x, bits, block = case
    got = torch.empty(x.numel())
    q = quantize(x, bits, block, dequantized=got)
    want = dequantize(q, torch.float32).reshape(-1)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("bits", [8, 4])
def test_dequantized_output_across_chunks_with_signed_zeros_and_a_ragged_block(bits, monkeypatch):
    import zeropp.quant as quant
    monkeypatch.setattr(quant, "CHUNK_BYTES", 4 * 64 * 3)  # 3 blocks of 64 per chunk
    x = torch.randn(64 * 10 + 22) * 1e-3
    x[::7], x[3::11] = 0.0, -0.0  # rounding leaves -0.0; an unpacked integer gives +0.0
    got = torch.empty(x.numel())
    q = quantize(x, bits, 64, dequantized=got)
    assert torch.equal(got.view(torch.int32), dequantize(q).view(torch.int32))


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="dequantized must be a contiguous fp32 tensor of 4"):
        quantize(torch.ones(4), 8, dequantized=torch.empty(5))
    with pytest.raises(ValueError, match="bits=3"):
        quantize(torch.ones(4), 3)
    with pytest.raises(ValueError, match="block_size=7"):
        quantize(torch.ones(4), 8, 7)
    with pytest.raises(TypeError, match="stochastic"):  # retired: nearest rounding only
        quantize(torch.ones(4), 8, stochastic=True)


# ---- 2 bits ([Note: 2 bits]) ----------------------------------------------------------
@st.composite
def cases2(draw):
    x = _tensor(draw)
    return x, draw(st.sampled_from([4, 8, 64, 100, 2048]))


def _nearest_level_error(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    levels = torch.tensor([-3.0, -1.0, 1.0, 3.0])
    return (x.unsqueeze(-1) - levels * s.unsqueeze(-1)).abs().min(dim=-1).values


@settings(max_examples=300, deadline=None)
@given(cases2())
def test_two_bits_scale_is_min_of_half_the_rms_and_a_third_of_absmax_and_values_take_the_nearest_level(case):
    """scale = min(rms/2, absmax/3) per block (to an ulp); every value decodes to the
    level of -3, -1, +1, +3 scales nearest to it (to fp32 rounding); the dequantized
    copy a sender keeps is bit for bit what dequantize gives."""
    x, block = case
    deq = torch.empty(x.numel())
    q = quantize(x, 2, block, dequantized=deq)
    assert q.data.numel() == -(-x.numel() // block) * block // 4
    d = dequantize(q, torch.float32).view(-1)
    assert torch.equal(d, deq)
    xf = torch.nn.functional.pad(x.float().view(-1), (0, -x.numel() % block)).view(-1, block)
    want = torch.minimum(xf.pow(2).mean(1).sqrt() / 2, xf.abs().amax(1) / 3)
    assert torch.allclose(q.scales, want, rtol=1e-5, atol=0), (q.scales, want)
    s = _elementwise_scale(q).view(-1)
    err = (x.float().view(-1) - d).abs()
    best = _nearest_level_error(x.float().view(-1), s)
    assert bool((err <= best + 4 * EPS32 * (x.float().abs().view(-1) + 3 * s)).all())


def test_two_bits_pack_unpack_is_a_bijection_on_all_256_bytes_with_element_4i_lowest():
    from zeropp.quant import pack_int2, unpack_int2
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = unpack_int2(every)
    assert codes.numel() == 1024 and int(codes.max()) == 3
    assert torch.equal(pack_int2(codes.float() * 2 - 3), every)
    assert pack_int2(torch.tensor([3.0, -3.0, -3.0, -3.0])).item() == 0b00000011
    assert pack_int2(torch.tensor([-3.0, -3.0, -3.0, 3.0])).item() == 0b11000000


def test_two_bits_zeros_ties_and_non_finite_blocks():
    """An all-zero block is scale 0 and exact zeros; ties go upward (0 -> +1 scale);
    a NaN makes its own block non-finite and leaves the next one alone."""
    z = quantize(torch.zeros(12), 2, 4)
    assert torch.equal(z.scales, torch.zeros(3)) and torch.equal(dequantize(z), torch.zeros(12))
    x = torch.tensor([0.0, 2.0, -2.0, 6.0, float("nan"), 1.0, 1.0, 1.0, 3.0, -1.0, 1.0, -3.0])
    q = quantize(x, 2, 4)
    d = dequantize(q)
    s0 = q.scales[0].item()
    assert s0 == pytest.approx(min(math.sqrt((4 + 4 + 36) / 4) / 2, 2.0))
    assert d[0].item() == s0  # 0 reaches the threshold 0: level +1
    assert bool(d[4:8].isnan().all())
    assert torch.equal(d[8:], dequantize(quantize(x[8:], 2, 4)))


def test_two_bits_needs_blocks_of_a_multiple_of_four():
    with pytest.raises(ValueError, match="multiple of 4"):
        quantize(torch.ones(12), 2, 6)
    with pytest.raises(ValueError, match="2, 4 or 8"):
        quantize(torch.ones(12), 3, 4)
