"""Blockwise symmetric quantization (INT8 / INT4 / 2-bit), pure PyTorch on any device.

The flat input is cut into blocks of `block_size` elements (the last one zero-padded); each
block gets one fp32 scale `absmax / qmax` (qmax = 127 for 8 bits, 7 for 4 bits) and integers
`round(x / scale)` in [-qmax, qmax]. The range is symmetric (DeepSpeed divides by 128 and clips
+absmax to 127); an all-zero block has scale 0 and decodes to exact zeros. Arithmetic is fp32
whatever the input dtype (DeepSpeed's kernels read every input as fp16).

[Note: 2 bits]
Levels -3, -1, +1, +3 scales, code c for 2c - 3 (no zero level: error feedback, which 2 bits
needs, carries what a level misses). The scale is min(rms / 2, absmax / 3), not absmax / 3,
which puts most values far from their level: a block's relative squared error 0.12 against
0.52 on Gaussian values, 0.33 against 20 on Student-t(3) (1000 blocks of 2048). A code counts
the thresholds -2, 0, +2 scales its value reaches (ties upward); four codes a byte, element 4i
lowest; blocks a multiple of 4. An all-zero block decodes to zeros.
"""

from __future__ import annotations

import math
import sys
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from . import kernels

_QMAX = {8: 127, 4: 7, 2: 3}
# Smallest normal fp32, the scale of a non-zero block whose absmax / qmax is below it:
# a subnormal scale is rounded too coarsely (134 * 2^-149 / 127 is 2^-149), so x / scale
# could leave [-qmax, qmax]; this one keeps every code in range and x / scale finite.
_TINY = torch.finfo(torch.float32).smallest_normal


@dataclass
class QTensor:
    data: torch.Tensor      # int8 (8 bits) or packed uint8 (4 and 2 bits), whole blocks
    scales: torch.Tensor    # fp32, one per block
    shape: torch.Size
    dtype: torch.dtype      # the input's dtype, restored by dequantize
    bits: int
    block_size: int
    wire: Optional[torch.Tensor] = None  # the uint8 buffer data and scales live in

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def payload_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def scale_bytes(self) -> int:
        return self.scales.numel() * 4

    def to_bytes(self) -> torch.Tensor:
        """One uint8 buffer: scales (fp32 bytes), then data; no copy if they share one already."""
        return self.wire if self.wire is not None else torch.cat(
            [self.scales.view(torch.uint8), self.data.view(torch.uint8)])

    @staticmethod
    def wire_bytes(numel: int, bits: int, block_size: int) -> int:
        """Length of `to_bytes()` for a tensor of `numel` elements."""
        nblocks = -(-numel // block_size)
        return nblocks * 4 + nblocks * block_size * bits // 8

    @classmethod
    def from_bytes(cls, buf: torch.Tensor, shape, dtype: torch.dtype, bits: int,
                   block_size: int) -> QTensor:
        """Inverse of `to_bytes` (given the metadata every rank already knows)."""
        shape = torch.Size(shape)
        nblocks = -(-math.prod(shape) // block_size)
        expected = cls.wire_bytes(math.prod(shape), bits, block_size)
        if buf.dtype != torch.uint8 or buf.numel() != expected:
            raise ValueError(f"QTensor.from_bytes: expected {expected} uint8 bytes for shape "
                             f"{tuple(shape)}, {bits} bits, block {block_size}; got "
                             f"{buf.numel()} of {buf.dtype}")
        head, wire = buf[:nblocks * 4], buf
        if head.storage_offset() % 4:
            head, wire = head.clone(), None  # fp32 views need 4-byte alignment
        data = buf[nblocks * 4:]
        return cls(data.view(torch.int8) if bits == 8 else data, head.view(torch.float32),
                   shape, dtype, bits, block_size, wire)


def _check(bits: int, block_size: int) -> None:
    if bits not in _QMAX:
        raise ValueError(f"quantize: bits={bits!r} is invalid; allowed: 2, 4 or 8")
    if not (isinstance(block_size, int) and block_size >= 2 and block_size % 2 == 0):
        raise ValueError(f"quantize: block_size={block_size!r} is invalid; allowed: an even "
                         "integer >= 2")
    if bits == 2 and block_size % 4:
        raise ValueError(f"quantize: block_size={block_size!r} is invalid at 2 bits; allowed: "
                         "a multiple of 4 (four codes to a byte)")


# Blocks go in chunks of about this many fp32 bytes, so temporaries stay in cache and are never
# page-faulted in, which costs more than the arithmetic on this CPU (touching a fresh 64 MB
# buffer: ~25 ms; an in-cache pass: ~3 ms). Larger chunks amortize per-op dispatch until past L3.
CHUNK_BYTES = 1 << 22  # best of 256 KiB..16 MiB measured here (32 MiB L3)
# A GPU has no cache cliff, and each op of a chunk is a kernel launch: on the H200, INT8 quantize
# of 256 MiB ran at 24 GB/s in 4 MiB chunks (a copy: 1940), 190 in 32 MiB, 331 in 128 MiB, 360
# whole (benchmarks/gpu/*quant_chunks*). 128 MiB: nearly all that, scratch slots at most 128 MiB.
DEVICE_CHUNK_BYTES = 1 << 27


def _chunks(nblocks: int, block_size: int, device: torch.device, start: int = 0):
    """Chunks (r0, r1) of blocks [start, nblocks)."""
    size = DEVICE_CHUNK_BYTES if device.type == "cuda" else CHUNK_BYTES
    rows = max(1, size // (4 * block_size))
    for r0 in range(0, nblocks, rows):
        if min(r0 + rows, nblocks) > start:
            yield max(r0, start), min(r0 + rows, nblocks)


# Reused fp32 buffers per (thread, stream, slot, device): the reduce pipeline's two stages run
# at once on their own threads. memory_stats counts them ("scratch"); shard.py frees them after
# every forward and backward.
_SCRATCH: dict[tuple, torch.Tensor] = {}


def scratch_buffer(slot: str, numel: int, device: torch.device) -> torch.Tensor:
    """A reused fp32 buffer of `numel` for temporaries that die within one call. A fresh unit-sized
    one may be mmap'd and page-faulted in every call (host_memory.py): error feedback's encode
    of a 1.8M-value unit took 3.1 ms with fresh temporaries, 0.53 ms with these
    (benchmarks/probes/encode_probe.py). One per CUDA stream: FSDP2 all-gathers and
    reduce-scatters on two streams from one thread; neither may write what the other reads."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (threading.get_ident(), stream, slot, str(device))
    t = _SCRATCH.get(key)
    if t is None or t.numel() < numel:
        t = _SCRATCH[key] = torch.empty(numel, dtype=torch.float32, device=device)
    return t[:numel]


def scratch_bytes() -> int:
    return sum(t.numel() * 4 for t in list(_SCRATCH.values()))


def release_scratch() -> None:
    """Drop the scratch buffers: they live only while a phase uses them (one in use lives on
    through its user), as the temporaries they replace did."""
    _SCRATCH.clear()


_DIVISORS: dict[tuple, torch.Tensor] = {}  # (divisor, device) -> it on the device


def div_exact(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c correctly rounded on every device. PyTorch's CUDA kernel divides by a Python
    number as a multiplication by its reciprocal, an ulp off for some x (the H200 and the CPU
    gave 23 of 512 scales absmax / 127 apart); by a tensor on the device it truly divides."""
    if x.device.type == "cpu":
        return x / c
    key = (float(c), str(x.device))
    if key not in _DIVISORS:
        _DIVISORS[key] = torch.tensor(float(c), device=x.device)
    return torch.div(x, _DIVISORS[key])


def absmax_rows(x: torch.Tensor) -> torch.Tensor:
    """max |x| of each row of a 2-D tensor, NaN propagated (canonical_absmax)."""
    # max(amax, -amin): two fast reductions; |x| would need a temporary and
    # vector_norm(ord=inf) is ~10x slower here. Both propagate NaN.
    return canonical_absmax(torch.maximum(x.amax(dim=1), x.amin(dim=1).neg()))


def canonical_absmax(m: torch.Tensor) -> torch.Tensor:
    """+0 for an all-zero row (max(+0, -0) is either, by kernel path) and the quiet NaN for any
    NaN (sign, payload), so the scale's bytes depend on neither the size nor the kernel."""
    return torch.where(m == 0, 0.0, torch.where(m.isnan(), math.nan, m))


def block_scales(absmax: torch.Tensor, qmax: int) -> torch.Tensor:
    """Each block's scale absmax / qmax, at least _TINY where absmax > 0."""
    s = div_exact(absmax, qmax)
    return torch.where((s < _TINY) & (absmax > 0), _TINY, s)


def round_blocks(xc: torch.Tensor, qmax: int, v: torch.Tensor) -> torch.Tensor:
    """Each row's scale (returned) and the integers `quantize` stores, into `v` (fp32, the
    rows' shape): values / scale rounded half to even, the scale absmax / qmax; at 2 bits
    (qmax 3, [Note: 2 bits]) each value's level, a non-finite block's -3 (code 0)."""
    absmax = absmax_rows(xc)
    if qmax == 3:
        rms = torch.linalg.vector_norm(xc, dim=1).div_(math.sqrt(xc.shape[1]))
        # x^2 past fp32's range makes rms inf while absmax is finite: the cap then holds
        s = block_scales(torch.minimum(rms.mul_(1.5), absmax), 3)
        two = (2 * s).unsqueeze(1)  # exact: a power of two
        v.copy_(xc >= two.neg()).add_(xc >= 0).add_(xc >= two).mul_(2).sub_(3)
        _fill_non_finite(s, v, -3.0)  # decodes to non-finite values
        return s
    s = block_scales(absmax, qmax)
    # divide, not multiply by 1/scale (a subnormal's inverse overflows); a zero block by 1
    torch.div(xc, torch.where(s > 0, s, 1.0).unsqueeze(1), out=v)
    v.round_()  # |x/scale| <= qmax (+ an ulp), so it rounds into range
    # A non-finite block's codes are 0 (it decodes to NaN by its scale): its values
    # would convert to integers undefined by C, differently by kernel.
    _fill_non_finite(s, v, 0.0)
    return s


def _fill_non_finite(s: torch.Tensor, v: torch.Tensor, fill: float) -> Optional[torch.Tensor]:
    """Fills the rows of `v` whose scale is non-finite with `fill` and returns their mask:
    on the CPU only where a block needs it (else None); on a device always (no sync)."""
    bad = ~s.isfinite()
    if not (v.is_cuda or bool(bad.any())):
        return None
    v.masked_fill_(bad.unsqueeze(1), fill)
    return bad


def quantize(x: torch.Tensor, bits: int = 8, block_size: int = 2048, *,
             out: Optional[torch.Tensor] = None,
             dequantized: Optional[torch.Tensor] = None) -> QTensor:
    """Blockwise symmetric absmax quantization (the module note), rounding half to even. Data
    and scales go in wire format into one uint8 buffer (`out`, if given: 4-byte aligned,
    `QTensor.wire_bytes(...)` long), so `to_bytes()` costs nothing. `dequantized` (contiguous
    fp32, x.numel() values) receives `dequantize()` of the result, bit for bit, made in cache:
    a sender that needs what the receiver will see (error feedback, qWD's owner) skips
    unpacking its bytes."""
    _check(bits, block_size)
    qmax = _QMAX[bits]
    nbytes = QTensor.wire_bytes(x.numel(), bits, block_size)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    elif out.dtype != torch.uint8 or out.numel() != nbytes or out.storage_offset() % 4:
        raise ValueError(f"quantize: out must be a 4-byte aligned uint8 tensor of {nbytes} "
                         f"bytes, got {out.numel()} of {out.dtype}")
    deq = dequantized
    if deq is not None and (deq.dtype != torch.float32 or deq.numel() != x.numel()
                            or not deq.is_contiguous()):
        raise ValueError(f"quantize: dequantized must be a contiguous fp32 tensor of "
                         f"{x.numel()} values, got {tuple(deq.shape)} of {deq.dtype}")
    q = QTensor.from_bytes(out, x.shape, x.dtype, bits, block_size)
    scales, data, per_block = q.scales, q.data, block_size * bits // 8
    flat, bs, n, dev = x.reshape(-1), block_size, x.numel(), x.device
    deq = deq.view(-1) if deq is not None else None
    whole, done = n // bs, 0  # blocks [0, done) are quantized; the kernel takes whole ones
    if whole and kernels.enabled(dev, n, bits):
        codes = data[:whole * per_block].view(-1, per_block)
        dq = None if deq is None else deq[:whole * bs].view(-1, bs)
        absmax = kernels.quantize_into(flat[:whole * bs].view(-1, bs), codes, bits, dq)
        if absmax is not None:
            done = whole
            s = scales[:whole] = block_scales(canonical_absmax(absmax.view(-1)), qmax)
            # round_blocks' non-finite block: codes 0 (as stored) and a dequantized 0 * scale
            bad = _fill_non_finite(s, codes, 0 if bits == 8 else 0x88)
            if bad is not None and dq is not None:
                dq.copy_(torch.where(bad.unsqueeze(1), s.unsqueeze(1) * 0.0, dq))
    for r0, r1 in _chunks(q.scales.numel(), bs, dev, done):
        xc = _rows(flat, r0, r1, bs)
        v = scratch_buffer("quantize", xc.numel(), dev).view(xc.shape)
        s = scales[r0:r1] = round_blocks(xc, qmax, v)
        packed = v.view(-1) if bits == 8 else pack_int4(v) if bits == 4 else pack_int2(v)
        data[r0 * per_block:r1 * per_block].copy_(packed)  # exact: v holds integers
        if deq is not None:
            # dequantize's arithmetic; + 0 turns rounding's -0.0 into an unpacked integer's +0.0
            v.add_(0.0).mul_(s.unsqueeze(1))
            end = min(r1 * bs, n)
            deq[r0 * bs:end].copy_(v.view(-1)[:end - r0 * bs])
    return q


def _rows(flat: torch.Tensor, r0: int, r1: int, bs: int) -> torch.Tensor:
    """Blocks r0..r1 of `flat` as fp32 (r1 - r0, bs), the last one zero-padded."""
    rows = flat[r0 * bs:r1 * bs].float()
    pad = (r1 - r0) * bs - rows.numel()
    return (torch.nn.functional.pad(rows, (0, pad)) if pad else rows).view(-1, bs)


def dequantize(q: QTensor, dtype: Optional[torch.dtype] = None, *,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The tensor `q` stands for, in `dtype` (default: the original), into `out` if given
    (contiguous, q.numel elements; its dtype wins)."""
    dtype = out.dtype if out is not None else (dtype or q.dtype)
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.scales.device)
    elif out.numel() != q.numel or not out.is_contiguous():
        raise ValueError(f"dequantize: out must be contiguous with {q.numel} elements, got "
                         f"{tuple(out.shape)}")
    flat, bs, n = out.view(-1), q.block_size, q.numel
    per_block = bs * q.bits // 8
    scratch = torch.empty(0, dtype=torch.float32, device=out.device)  # not the default dtype
    whole, done = n // bs, 0  # the compiled kernel takes whole blocks (kernels.py)
    if whole and kernels.enabled(out.device, n, q.bits) and kernels.dequantize_into(
            q.data[:whole * per_block].view(whole, per_block),
            q.scales[:whole].view(whole, 1), flat[:whole * bs].view(whole, bs), q.bits):
        done = whole
    for r0, r1 in _chunks(q.scales.numel(), bs, out.device, done):
        raw = q.data[r0 * per_block:r1 * per_block]
        vals = raw if q.bits == 8 else _unpack_offset(raw) if q.bits == 4 else unpack_int2(raw)
        if dtype == torch.float32 and r1 * bs <= n:  # straight into out, scaled in cache
            dst = flat[r0 * bs:r1 * bs].view(-1, bs)
        else:  # another dtype, or the padded last block
            dst = scratch = scratch.resize_(r1 - r0, bs)
        dst.copy_(vals.view(-1, bs))
        if q.bits == 4:
            dst.sub_(8)  # nibbles hold value + 8
        elif q.bits == 2:
            dst.mul_(2).sub_(3)  # code c stands for level 2c - 3
        dst.mul_(q.scales[r0:r1].unsqueeze(1))
        if dst is scratch:
            end = min(r1 * bs, n)
            flat[r0 * bs:end].copy_(scratch.view(-1)[:end - r0 * bs])
    return out


# Packing reads byte pairs as little-endian int16 (x86, ARM): contiguous, vectorized ops.
assert sys.byteorder == "little", "INT4 packing assumes a little-endian host"


def dequantize_pieces(wire: torch.Tensor, out: torch.Tensor, *, pieces: int, bits: int,
                      block: int, slots: Optional[list[int]] = None) -> None:
    """Dequantize `wire` (a gathered buffer: `pieces` equal wire-format pieces) into `out`
    (flat, compute dtype): piece r into slot `slots[r]` (default r) of `pieces` equal slots."""
    wb, numel = wire.numel() // pieces, out.numel() // pieces
    for r in range(pieces):
        s = r if slots is None else slots[r]
        q = QTensor.from_bytes(wire[r * wb:(r + 1) * wb], (numel,), out.dtype, bits, block)
        dequantize(q, out=out[s * numel:(s + 1) * numel])


def edit_wire(wire: torch.Tensor, values: torch.Tensor, changed: torch.Tensor, *, bits: int,
              block: int) -> torch.Tensor:
    """The wire bytes of flat tensor `wire` with `values[changed]` written in (`changed`: a
    mask over its elements): the edited blocks requantized, the others bit for bit unchanged."""
    old = QTensor.from_bytes(wire, (changed.numel(),), torch.float32, bits, block)
    cur = dequantize(old, torch.float32)
    cur[changed] = values[changed].float()
    new = quantize(cur, bits, block)
    blocks = changed.view(-1, block).any(dim=1)
    nb = blocks.numel()
    scales = torch.where(blocks, new.scales, old.scales)
    data = torch.where(blocks[:, None], new.data.view(torch.uint8).view(nb, -1),
                       old.data.view(torch.uint8).view(nb, -1))
    return torch.cat([scales.view(torch.uint8), data.reshape(-1)])


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Integers in [-8, 7] (any integer or float dtype, even count) -> uint8, two per byte
    (low nibble first)."""
    # via int8: fp32 -> uint8 is 5x slower than fp32 -> int8 here. Offset by 8, a pair is
    # lo | hi << 8 (both 0..15), so pairs | pairs >> 4 holds lo | hi << 4 in its low byte,
    # which the narrowing keeps: two ops fewer than masking each nibble, 0.72x the time
    # here (docs/notebook.md, "INT4 packing").
    pairs = q.reshape(-1).to(torch.int8, copy=True).add_(8).view(torch.int16)
    return (pairs >> 4).bitwise_or_(pairs).to(torch.uint8)


def _unpack_offset(packed: torch.Tensor) -> torch.Tensor:
    """uint8 -> uint8 nibbles 0..15 (value + 8), twice as many, in order."""
    p = packed.reshape(-1).to(torch.int16)  # hi << 4 | lo -> hi << 8 | lo
    return (p << 4).bitwise_or_(p).bitwise_and_(0x0F0F).view(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: uint8 -> int8 values in [-8, 7], twice as many."""
    return _unpack_offset(packed).view(torch.int8) - 8


def pack_int2(v: torch.Tensor) -> torch.Tensor:
    """Levels -3, -1, +1, +3 (fp32, a multiple of 4 of them) -> uint8, four codes
    (level + 3) / 2 to a byte, element 4i in the lowest two bits."""
    # four codes as the bytes of a little-endian int32, each in its low two bits; the shifts
    # bring byte k's bits to 2k..2k+1 of the low byte, which the narrowing keeps (pack_int4)
    w = v.reshape(-1).add(3).div_(2).to(torch.uint8).view(torch.int32)
    return ((w >> 6) | (w >> 12) | (w >> 18)).bitwise_or_(w).to(torch.uint8)


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int2 to the codes: uint8 -> uint8 codes 0..3, four times as many."""
    p = packed.reshape(-1).to(torch.int32)
    return ((p << 6) | (p << 12) | (p << 18)).bitwise_or_(p).bitwise_and_(0x03030303).view(
        torch.uint8)
