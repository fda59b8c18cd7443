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
A block whose codes all moved by at most dmax (k = 1) lands exactly on t; a
faster one (small weights that the optimizer moves by many of their steps) lands
within k/2 codes of it, as an INT4 delta of the values would, and the rest is in
the next step's diff (carried, not lost). Every holder and the owner run the same
float ops on the same integers and scales, so their copies stay bitwise
identical; integer arithmetic in fp32 is exact below 2^24.

Most blocks skip the rescaling (k = 0): since |t - base| <= |t - c| +
qmax |1 - s/s'| + 1/2, a block where that bound is under dmax + 1 gets k = 1 and
t from the formula, and the moves on the old grid, d = t - c, land on t as well:
an integer subtraction for the owner and an int8 add for every holder, the same
copies bit for bit. The owner runs the formula on the other blocks only, and also
sends k = 0 where it gave k = 1 and t - c fits. A scale moves little per step, so
most blocks take k = 0 (97% over 300 steps of `small` at lr 2e-3, 87% at the
peak; benchmarks/probes/qwd_moves.py).

The copies cost the holder 1 byte per value (plus a scale per block) instead
of 4 for fp32 copies and their INT8 payload, and no re-quantization per step.

INT3 moves (`weight_delta_bits=3`, dmax = 3) send a quarter fewer bytes; more
blocks then take k > 1 (and land within a code of t), the rest still exactly.

On a GPU the same bits come without host syncs: finding the rescaled blocks
would sync, so there every block goes through both ways and `torch.where` keeps
each block's own (`_rows`).

[Note: delta wire format]
One uint8 buffer per shard: [s' fp32 x nblocks | k uint8 x nblocks (0: moves on
the old grid), padded to 4 bytes | d at `delta_bits` (INT4 packed as quant.py
packs it, INT3 eight to three bytes), padded to 4 bytes]. The scales lead so
that pieces cut from a gathered buffer keep them 4-byte aligned.
"""

from __future__ import annotations

from typing import Optional

import torch

from .quant import (
    _QMAX,
    _blocks,
    _chunks,
    absmax_rows,
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


def _store(codes: torch.Tensor, data: torch.Tensor, bits: int, r0: int, r1: int,
           block: int) -> None:
    per = block * bits // 8
    dst = data[r0 * per:r1 * per]
    dst.copy_(codes.view(-1) if bits == 8 else pack_int4(codes) if bits == 4
              else pack_int3(codes))


def _int8(data: torch.Tensor, bits: int, r0: int, r1: int, block: int) -> torch.Tensor:
    """Blocks r0..r1 of a code array as int8 (r1 - r0, block): a view of INT8 codes."""
    per = block * bits // 8
    raw = data[r0 * per:r1 * per]
    ints = raw if bits == 8 else unpack_int4(raw) if bits == 4 else unpack_int3(raw).to(torch.int8)
    return ints.view(r1 - r0, block)


def _ratio(s_old: torch.Tensor, s_new: torch.Tensor) -> torch.Tensor:
    """s / s' per block; 0 where it is not usable (a zero, subnormal or non-finite
    scale): such a block starts from 0."""
    ratio = s_old / s_new
    return torch.where((s_new > 0) & torch.isfinite(ratio), ratio, 0.0)


def _base(c: torch.Tensor, s_old: torch.Tensor, s_new: torch.Tensor, qmax: int) -> torch.Tensor:
    """The old codes on the new grid, in place: clamp(round(c * s / s'))."""
    ratio = _ratio(s_old, s_new)
    c.mul_(ratio.unsqueeze(1)).round_()
    # |c| <= qmax: only a grid that got finer (ratio > 1) can take it out of range.
    # On a device the test would cost a host sync, and the clamp is the identity on
    # codes in range, so it always clamps there.
    return c.clamp_(-qmax, qmax) if c.is_cuda or bool((ratio > 1).any()) else c


def _rows(mask: torch.Tensor):
    """The blocks of `mask` (one bool per block) that need more work: on the CPU
    their indices (None if none), or all blocks (slice(None)) where that is most, as
    on a device always, because finding them syncs the host. Work done on all blocks
    gives the others' results unchanged or chosen back: the same bits either way."""
    if mask.is_cuda:
        return slice(None)
    rows = mask.nonzero().squeeze(1)
    return None if not len(rows) else slice(None) if 2 * len(rows) > len(mask) else rows


def _formula(t: torch.Tensor, c: torch.Tensor, s_old: torch.Tensor, s_new: torch.Tensor,
             qc: int, qd: int, stochastic: bool, generator: Optional[torch.Generator],
             diff_out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The note's formula on some blocks, for the owner: t (qwZ's new codes) and c
    (the old codes), fp32, both overwritten (c by base, t by c'). Returns the moves d
    and the steps k (fp32)."""
    base = _base(c, s_old, s_new, qc)
    diff = torch.sub(t, base, out=diff_out)
    # |diff| <= qd * k, so |diff / k| <= qd (division rounds correctly): nearest
    # rounding stays in range; floor(qd + u) is qd + 1 where fp32 rounds qd + u up
    k = div_exact(absmax_rows(diff), qd).ceil_().clamp_(1, 255)
    far = _rows(k > 1)
    if far is not None:  # where k = 1, d = diff exactly and c' = t
        every = isinstance(far, slice)
        kf = k[far].unsqueeze(1)
        d = torch.div(diff[far], kf,
                      out=scratch_buffer("qwd_q", diff.numel(), t.device).view(diff.shape)
                      if every else None)
        if stochastic:
            d.add_(torch.rand(d.shape, generator=generator, device=d.device)).floor_()
            d.clamp_(-qd, qd)
            if every:  # k = 1 keeps d = diff: floor(3 + u) is 4 where fp32 rounds 3 + u up
                torch.where(kf > 1, d, diff, out=d)
        else:
            d.round_()
        diff[far] = d
        if every:
            _far(base, diff, kf, qc, out=t)
        else:
            t[far] = _far(base[far], d, kf, qc)
    return diff, k


def _far(base: torch.Tensor, d: torch.Tensor, kf: torch.Tensor, qc: int,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """c' = clamp(base + d * k), into `out` (default: `base`): the same ops on the
    owner and on every holder. Products and sums are integers below 2^24, exact in fp32."""
    return torch.addcmul(base, d, kf, out=base if out is None else out).clamp_(-qc, qc)


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
    # the padding after the steps and after the moves: zeros, not whatever the
    # buffer held (it goes to other processes, and byte comparisons see it)
    nb, per = numel // block, block * delta_bits // 8
    steps_pad, data_pad = out[nb * 5:nb * 4 + extra], d_data[nb * per:]
    for pad in (steps_pad, data_pad):
        if pad.numel():
            pad.zero_()
    xb = _blocks(master, block)
    for r0, r1 in _chunks(nb, block, master.device):
        shape = (r1 - r0, block)
        # t: qwZ's codes of the master (quantize's arithmetic), in fp32
        t = scratch_buffer("qwd_t", shape[0] * block, master.device).view(shape)
        # (a non-finite master's block gets codes 0 from round_blocks: in range, and
        # its scale dequantizes to NaN whatever the codes)
        s_new[r0:r1] = sn = round_blocks(xb[r0:r1], qc, t)
        # t and the moves on the old grid as int16: integers in [-2 qmax, 2 qmax],
        # exact, and half the bytes of fp32 (int8 would wrap)
        c8 = _int8(c_data, copy_bits, r0, r1, block)
        t16 = _scratch_copy(t, torch.int16, "qwd_t16")
        moves = _scratch_copy(c8, torch.int16, "qwd_m16")
        torch.sub(t16, moves, out=moves)
        moved = absmax_rows(moves)
        # |t - clamp(round(c r))| <= |t - c| + qmax |1 - r| + 1/2 (c and t in range), an
        # integer: where the bound is under dmax + 1 the formula gives k = 1 and t, and so
        # do the moves on the old grid (k = 0); fp32's error in c r is under 1e-5. An
        # unusable scale counts as ratio 0, as in `_base`: which rows take the formula
        # decides how stochastic rounding draws its numbers (a zero block staying zero
        # passes when dmax >= qmax)
        rows = _rows(~(moved + qc * (1 - _ratio(s_old[r0:r1], sn)).abs() <= qd + 0.499))
        k = steps[r0:r1]
        k.zero_()
        if rows is not None:  # the formula on the others
            every = isinstance(rows, slice)
            cr = _scratch_copy(c8, torch.float32, "qwd_c") if every else c8[rows].float()
            tr = t if every else t[rows]
            diff, kr = _formula(tr, cr, s_old[r0:r1][rows], sn[rows], qc, qd, stochastic,
                                generator, scratch_buffer("qwd_d", t.numel(), t.device).view(shape)
                                if every else None)
            # k = 0 also where the formula lands on t (k = 1) and the moves on the old
            # grid fit: the same choice on every path, and each holder's cheap add
            direct = (kr == 1) & (moved[rows] <= qd)
            if every:
                moves.copy_(torch.where(direct.unsqueeze(1), moves, diff, out=diff))
                t16.copy_(tr)
            else:  # the direct rows hold their moves and t already
                moves[rows[~direct]] = diff[~direct].to(torch.int16)
                t16[rows[kr > 1]] = tr[kr > 1].to(torch.int16)  # k = 1 rows: c' = t
            k[rows] = torch.where(direct, 0.0, kr).to(torch.uint8)
        _store(moves, d_data, delta_bits, r0, r1, block)
        _store(t16, c_data, copy_bits, r0, r1, block)
    s_old.copy_(s_new)


def _scratch_copy(x: torch.Tensor, dtype: torch.dtype, slot: str) -> torch.Tensor:
    """x (integers that `dtype` holds exactly) as `dtype`, in a scratch buffer of x's shape."""
    n = x.numel()
    buf = scratch_buffer(slot, -(-n * dtype.itemsize // 4), x.device).view(dtype)[:n]
    return buf.view(x.shape).copy_(x)


def apply(copy: torch.Tensor, delta: torch.Tensor, *, numel: int, copy_bits: int,
          delta_bits: int, block: int) -> None:
    """A holder's side: move `copy` (one shard's wire bytes) by the owner's delta."""
    qc = _QMAX[copy_bits]
    s_old, _, c_data = _views(copy, numel, copy_bits, block)
    extra = meta_bytes(numel, block) - numel // block * 4
    s_new, steps, d_data = _views(delta, numel, delta_bits, block, extra)
    for r0, r1 in _chunks(numel // block, block, copy.device):
        k = steps[r0:r1]
        rows = _rows(k > 0)
        codes = _int8(c_data, copy_bits, r0, r1, block)
        moves = _int8(d_data, delta_bits, r0, r1, block)
        if rows is not None:  # the rescaled blocks, from their old codes
            base = _base(codes[rows].float(), s_old[r0:r1][rows], s_new[r0:r1][rows], qc)
            far = _far(base, moves[rows].float(), k[rows].unsqueeze(1).float(), qc)
            far = far.to(torch.int8)
        codes.add_(moves)  # k = 0: moves on the old grid, each landing on t
        if isinstance(rows, slice):
            torch.where((k == 0).unsqueeze(1), codes, far, out=codes)
        elif rows is not None:
            codes[rows] = far
        if copy_bits != 8:  # INT8 codes are a view of the copy, moved in place
            _store(codes, c_data, copy_bits, r0, r1, block)
    s_old.copy_(s_new)
