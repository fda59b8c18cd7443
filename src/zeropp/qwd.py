"""qWD's code deltas: INT8 copies of the weights kept current by integer steps.

[Note: why deltas of codes]
Each holder keeps its copies of other ranks' shards as qwZ's INT8 blocks (scales
and integer codes, the bytes its node gathers for every forward and backward).
After an optimizer step the owner of a shard quantizes its master exactly as
qwZ would (fresh absmax scale s' per block, codes t = round(m / s')) and sends
each holder how the codes moved. A weight moves by a few of its block's INT8
steps per optimizer step, so the move of its code is a small integer: INT4
carries it exactly, and the holder's copy becomes t, bit for bit qwZ's INT8 of
the master, at half of qwZ's bytes (and one scale per block, as before).

Per block, with the holder's codes c at scale s:
    base = clamp(round(c * s / s'))    # the old codes on the new scale's grid
    diff = t - base                    # an integer in [-2 qmax, 2 qmax]
    k    = max(1, ceil(max |diff| / dmax))   # the block's step, in codes (dmax 7 / 3)
    d    = round(diff / k)             # sent: s', k and d
    c'   = clamp(base + d * k)
A block whose codes all moved by at most dmax (k = 1: nearly every block) lands
exactly on t; a faster one (small weights that the optimizer moves by many of
their steps) lands within k/2 codes of it, as an INT4 delta of the values would,
and the rest is in the next step's diff (carried, not lost). Every holder and
the owner run the same float ops on the same integers and scales, so their
copies stay bitwise identical; integer arithmetic in fp32 is exact below 2^24.

The copies cost the holder 1 byte per value (plus a scale per block) instead
of 4 for fp32 copies and their INT8 payload, and no re-quantization per step.

INT3 moves (`weight_delta_bits=3`, dmax = 3) send a quarter fewer bytes; more
blocks then take k > 1 (and land within a code of t), the rest still exactly.

On a GPU the same bits come without host syncs: finding the k > 1 blocks would
sync, so there every block goes through the k > 1 formula, which for k = 1
gives d = diff and c' = t (`_far_rows`).

[Note: delta wire format]
One uint8 buffer per shard: [s' fp32 x nblocks | k uint8 x nblocks, padded to 4
bytes | d at `delta_bits` (INT4 packed as quant.py packs it, INT3 eight to three
bytes), padded to 4 bytes]. The scales lead so that pieces cut from a gathered
buffer keep them 4-byte aligned.
"""

from __future__ import annotations

from typing import Optional

import torch

from .quant import (
    _QMAX,
    _blocks,
    _chunks,
    device_constant,
    div_exact,
    pack_int4,
    round_blocks,
    scratch_buffer,
    unpack_int4,
)

_DMAX = {8: 127, 4: 7, 3: 3}  # the largest move a delta carries exactly, by its bits


def wire_bytes(numel: int, copy_bits: int, delta_bits: int, block: int) -> int:
    """Length of one shard's delta buffer (`numel` a multiple of `block`, itself a
    multiple of 8), padded to 4 bytes (INT3 moves of 8-value blocks end mid-word)."""
    nb = numel // block
    return nb * 4 + -(-nb // 4) * 4 + -(-(nb * block * delta_bits // 8) // 4) * 4


def meta_bytes(numel: int, block: int) -> int:
    """The bytes of a delta buffer that are not codes: scales and steps."""
    nb = numel // block
    return nb * 4 + -(-nb // 4) * 4


def _views(buf: torch.Tensor, numel: int, bits: int, block: int, extra: int = 0):
    """(scales, steps or None, data) views of a piece in wire format."""
    nb = numel // block
    scales = buf[:nb * 4].view(torch.float32)
    steps = buf[nb * 4:nb * 4 + nb] if extra else None
    data = buf[nb * 4 + extra:]
    return scales, steps, data.view(torch.int8) if bits == 8 else data


# INT3 moves: eight 3-bit fields (value + 4, so [-4, 3]; a move uses [-3, 3]) in three
# bytes, little-endian, the first value in the lowest bits.
def pack_int3(q: torch.Tensor) -> torch.Tensor:
    """Integer values in [-4, 3] (fp32, a count divisible by 8) -> uint8, 8 per 3 bytes.
    The 24-bit word is sum (v_i + 4) * 8^i, one matrix-vector product in fp32: every
    partial sum is an integer below 2^24, so exact in any order (half the time of
    shifting and or-ing int32 fields here)."""
    pow8 = device_constant(("pow8",), q.device,
                           lambda d: torch.tensor([8.0 ** i for i in range(8)], device=d))
    words = torch.mv(q.reshape(-1, 8).float(), pow8).add_(4 * (8 ** 8 - 1) / 7)
    return words.to(torch.int32).view(torch.uint8).view(-1, 4)[:, :3].reshape(-1)


def unpack_int3(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int3: uint8 -> int32 values in [-4, 3], 8 per 3 bytes."""
    shifts = device_constant(("shifts3",), packed.device,
                             lambda d: torch.arange(0, 24, 3, dtype=torch.int32, device=d))
    b = packed.reshape(-1, 3).to(torch.int32)
    words = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    return (words.unsqueeze(1) >> shifts).bitwise_and_(7).sub_(4).reshape(-1)


def _codes(data: torch.Tensor, bits: int, r0: int, r1: int, block: int,
           slot: str) -> torch.Tensor:
    """Blocks r0..r1 of a code array as fp32 integers (r1 - r0, block), in scratch."""
    per = block * bits // 8
    raw = data[r0 * per:r1 * per]
    ints = raw if bits == 8 else unpack_int4(raw) if bits == 4 else unpack_int3(raw)
    out = scratch_buffer(slot, (r1 - r0) * block, data.device).view(r1 - r0, block)
    return out.copy_(ints.view(r1 - r0, block))


def _store(codes: torch.Tensor, data: torch.Tensor, bits: int, r0: int, r1: int,
           block: int) -> None:
    per = block * bits // 8
    dst = data[r0 * per:r1 * per]
    dst.copy_(codes.view(-1) if bits == 8 else pack_int4(codes) if bits == 4
              else pack_int3(codes))


def _base(c: torch.Tensor, s_old: torch.Tensor, s_new: torch.Tensor, qmax: int) -> torch.Tensor:
    """The old codes on the new grid, in place: clamp(round(c * s / s')). A block
    without a usable ratio (a zero, subnormal or non-finite scale) starts from 0."""
    ratio = s_old / s_new
    ratio = torch.where((s_new > 0) & torch.isfinite(ratio), ratio, 0.0)
    c.mul_(ratio.unsqueeze(1)).round_()
    # |c| <= qmax: only a grid that got finer (ratio > 1) can take it out of range.
    # On a device the test would cost a host sync, and the clamp is the identity on
    # codes in range, so it always clamps there.
    return c.clamp_(-qmax, qmax) if c.is_cuda or bool((ratio > 1).any()) else c


def _far_rows(k: torch.Tensor):
    """The blocks that need the k > 1 formula: on the CPU those with k > 1 (None if
    none), or all of them (slice(None)) where that is most, as it is on a device
    always, because finding them syncs the host. For k = 1 the formula gives the same
    bits: d = round(diff / 1) = diff and clamp(base + d) = t, integers in range; so
    all-blocks only saves the gather and scatter of the rows (INT3 moves at lr 1e-3
    give k > 1 in most blocks)."""
    if k.is_cuda:
        return slice(None)
    rows = (k > 1).nonzero().squeeze(1)
    return None if not len(rows) else slice(None) if 2 * len(rows) > len(k) else rows


def _far(base: torch.Tensor, d: torch.Tensor, k: torch.Tensor, rows, qmax: int,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """c' = clamp(base + d * k) on the blocks `rows` (those with k > 1, or all), into
    `out` if given (all rows: may be `base` itself): the same ops on the owner and on
    every holder. Products and sums are integers below 2^24, exact in fp32."""
    kf = k[rows].float().unsqueeze(1)
    return torch.addcmul(base[rows], d[rows], kf, out=out).clamp_(-qmax, qmax)


def encode(master: torch.Tensor, copy: torch.Tensor, out: torch.Tensor, *, copy_bits: int,
           delta_bits: int, block: int, stochastic: bool = False,
           generator: Optional[torch.Generator] = None) -> None:
    """The owner's side: write the delta that moves `copy` (one shard's wire bytes
    at `copy_bits`) to qwZ's quantization of `master` into `out`, and apply it to
    `copy`, as every holder will."""
    numel = master.numel()
    qc, qd = _QMAX[copy_bits], _DMAX[delta_bits]
    s_old, _, c_data = _views(copy, numel, copy_bits, block)
    extra = meta_bytes(numel, block) - numel // block * 4
    s_new, steps, d_data = _views(out, numel, delta_bits, block, extra)
    xb = _blocks(master, block)
    for r0, r1 in _chunks(numel // block, block, master.device):
        # t: qwZ's codes of the master (quantize's arithmetic), kept in fp32
        t = scratch_buffer("qwd_t", (r1 - r0) * block, master.device).view(r1 - r0, block)
        s_new[r0:r1] = sn = round_blocks(xb[r0:r1], qc, t)
        base = _base(_codes(c_data, copy_bits, r0, r1, block, "qwd_c"), s_old[r0:r1], sn, qc)
        diff = torch.sub(t, base, out=scratch_buffer("qwd_d", t.numel(), t.device).view(t.shape))
        amax = torch.maximum(diff.amax(1), diff.amin(1).neg())
        # |diff| <= qd * k, so |diff / k| <= qd (division rounds correctly): nearest
        # rounding stays in range; floor(qd + u) is qd + 1 where fp32 rounds qd + u up
        k = div_exact(amax, qd).ceil_().clamp_(1, 255)
        steps[r0:r1] = k.to(torch.uint8)
        rows = _far_rows(k)
        if rows is not None:  # where k = 1, d = diff exactly and the copy becomes t
            every = isinstance(rows, slice)
            d = diff[rows]
            d = torch.div(d, k[rows].unsqueeze(1),
                          out=scratch_buffer("qwd_q", d.numel(), d.device).view(d.shape))
            if stochastic:
                d.add_(torch.rand(d.shape, generator=generator, device=d.device)).floor_()
                d.clamp_(-qd, qd)
                if every:  # k = 1 rows keep d = diff: floor(3 + u) is 4 where fp32
                    # rounds 3 + u up
                    torch.where((k > 1).unsqueeze(1), d, diff, out=d)
            else:
                d.round_()
            diff[rows] = d
            if every:
                _far(base, diff, k, rows, qc, out=t)
            else:
                t[rows] = _far(base, diff, k, rows, qc)
        _store(diff, d_data, delta_bits, r0, r1, block)
        _store(t, c_data, copy_bits, r0, r1, block)
    s_old.copy_(s_new)


def apply(copy: torch.Tensor, delta: torch.Tensor, *, numel: int, copy_bits: int,
          delta_bits: int, block: int) -> None:
    """A holder's side: move `copy` (one shard's wire bytes) by the owner's delta."""
    qc = _QMAX[copy_bits]
    s_old, _, c_data = _views(copy, numel, copy_bits, block)
    extra = meta_bytes(numel, block) - numel // block * 4
    s_new, steps, d_data = _views(delta, numel, delta_bits, block, extra)
    for r0, r1 in _chunks(numel // block, block, copy.device):
        base = _base(_codes(c_data, copy_bits, r0, r1, block, "qwd_c"), s_old[r0:r1],
                     s_new[r0:r1], qc)
        d = _codes(d_data, delta_bits, r0, r1, block, "qwd_d")  # fp32: a mixed add is slow
        k = steps[r0:r1]
        rows = _far_rows(k)
        if isinstance(rows, slice):
            _far(base, d, k, rows, qc, out=base)
        else:
            far = _far(base, d, k, rows, qc) if rows is not None else None
            base.add_(d)  # k = 1: t itself, in range
            if far is not None:
                base[rows] = far
        _store(base, c_data, copy_bits, r0, r1, block)
    s_old.copy_(s_new)
