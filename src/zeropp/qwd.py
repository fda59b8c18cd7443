"""qWD's code deltas: INT8 copies of the weights kept current by integer steps.

[Note: why deltas of codes]
Each holder keeps its copies of other ranks' shards as qwZ's INT8 blocks (scales and codes, the
bytes its node gathers for every forward and backward). After an optimizer step a shard's owner
quantizes its master exactly as qwZ would (fresh absmax scale s' per block, codes
t = round(m / s')) and sends each holder how the codes moved. A weight moves a few of its
block's INT8 steps per step, so its code's move is a small integer that INT4 carries exactly:
the holder's copy becomes t, bit for bit qwZ's INT8 of the master, at half qwZ's bytes (plus
one scale per block, as qwZ).

Per block, with the holder's codes c at scale s (qmax = QC = 127, qwZ's largest code;
dmax = QD = 7, the largest move INT4 carries):
    base = clamp(round(c * s / s'))    # the old codes on the new scale's grid
    diff = t - base                    # an integer in [-2 qmax, 2 qmax]
    k    = max(1, ceil(max |diff| / dmax))   # the block's step, in codes
    d    = round(diff / k)             # sent: s', k and d
    c'   = clamp(base + d * k)
A block whose codes all moved by at most dmax (k = 1) lands exactly on t; a faster one (small
weights the optimizer moves by many of their steps) lands within k/2 codes of it, as an INT4
delta of the values would, and the rest is carried in the next step's diff. The owner and every
holder run the same float ops on the same integers and scales, so their copies stay bitwise
identical (integers in fp32 are exact below 2^24).

Most blocks skip the rescaling (k = 0): since |t - base| <= |t - c| + qmax |1 - s/s'| + 1/2, a
block where that bound is under dmax + 1 gets k = 1 and t from the formula, and the moves on the
old grid, d = t - c, land on t too: an integer subtraction for the owner, an int8 add for each
holder, the same copies bit for bit. The owner runs the formula on the other blocks only, and
sends k = 0 also where it gave k = 1 and t - c fits. Scales move little per step, so most blocks
take k = 0 (97% over 300 steps of `small` at lr 2e-3, 87% at the peak;
benchmarks/probes/qwd_moves.py).

The holder's copies cost 1 byte per value (plus a scale per block) instead of 4 for fp32 copies
and their INT8 payload, and no re-quantization per step. On a GPU the same bits come without
host syncs: finding the rescaled blocks would sync, so every block goes both ways and
`torch.where` keeps each one's own (`_rows`).

[Note: delta wire format]
One uint8 buffer per shard: [s' fp32 x nblocks | k uint8 x nblocks (0: moves on the old grid),
padded to 4 bytes | d in INT4, packed as quant.py packs it]. The scales lead so that pieces cut
from a gathered buffer keep them 4-byte aligned.
"""

from __future__ import annotations

from typing import Optional

import torch

from .quant import (
    _chunks,
    absmax_rows,
    div_exact,
    pack_int4,
    round_blocks,
    scratch_buffer,
    unpack_int4,
)
from .quant import _rows as _fp32_rows

QC = 127  # the copies' largest code (qwZ's INT8)
QD = 7    # the largest move an INT4 delta carries exactly


def wire_bytes(numel: int, block: int) -> int:
    """Length of one shard's delta buffer (`numel` a multiple of `block`, itself of 8)."""
    return meta_bytes(numel, block) + numel // block * block // 2


def meta_bytes(numel: int, block: int) -> int:
    """The bytes of a delta buffer that are not codes: scales and steps."""
    nb = numel // block
    return nb * 4 + -(-nb // 4) * 4


def _views(buf: torch.Tensor, numel: int, block: int, delta: bool = False):
    """A delta's (scales, steps, data) views, or a copy's (scales, None, int8 codes)."""
    nb = numel // block
    scales = buf[:nb * 4].view(torch.float32)
    if not delta:
        return scales, None, buf[nb * 4:].view(torch.int8)
    return scales, buf[nb * 4:nb * 5], buf[meta_bytes(numel, block):]


def _ratio(s_old: torch.Tensor, s_new: torch.Tensor) -> torch.Tensor:
    """s / s' per block; 0 where unusable (a zero, subnormal or non-finite scale): base 0."""
    ratio = s_old / s_new
    return torch.where((s_new > 0) & torch.isfinite(ratio), ratio, 0.0)


def _base(c: torch.Tensor, s_old: torch.Tensor, s_new: torch.Tensor) -> torch.Tensor:
    """The old codes on the new grid, in place: clamp(round(c * s / s'))."""
    ratio = _ratio(s_old, s_new)
    c.mul_(ratio.unsqueeze(1)).round_()
    # |c| <= QC: only a grid that got finer (ratio > 1) can take it out of range. On a
    # device, where the test would sync the host, it always clamps (the identity in range).
    return c.clamp_(-QC, QC) if c.is_cuda or bool((ratio > 1).any()) else c


def _rows(mask: torch.Tensor):
    """The blocks of `mask` (one bool per block) that need more work: on the CPU their
    indices (None if none) or, where that is most, all blocks (slice(None)), as always on a
    device (finding them syncs). Work on all blocks gives the others the same bits."""
    if mask.is_cuda:
        return slice(None)
    rows = mask.nonzero().squeeze(1)
    return None if not len(rows) else slice(None) if 2 * len(rows) > len(mask) else rows


def _formula(t: torch.Tensor, c: torch.Tensor, s_old: torch.Tensor, s_new: torch.Tensor,
             diff_out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The note's formula on some blocks, for the owner: t (qwZ's new codes) and c (the old
    codes), fp32, both overwritten (c by base, t by c'). Returns the moves d and steps k (fp32)."""
    base = _base(c, s_old, s_new)
    diff = torch.sub(t, base, out=diff_out)
    # |diff| <= QD * k, so |diff / k| <= QD (a correctly rounded division): d is in range
    k = div_exact(absmax_rows(diff), QD).ceil_().clamp_(1, 255)
    far = _rows(k > 1)
    if far is not None:  # where k = 1, d = diff exactly and c' = t
        every = isinstance(far, slice)
        kf = k[far].unsqueeze(1)
        d = torch.div(diff[far], kf,
                      out=scratch_buffer("qwd_q", diff.numel(), t.device).view(diff.shape)
                      if every else None).round_()
        diff[far] = d
        if every:
            _far(base, diff, kf, out=t)
        else:
            t[far] = _far(base[far], d, kf)
    return diff, k


def _far(base: torch.Tensor, d: torch.Tensor, kf: torch.Tensor,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """c' = clamp(base + d * k), into `out` (default: `base`): the same ops on the
    owner and on every holder. Products and sums are integers below 2^24, exact in fp32."""
    return torch.addcmul(base, d, kf, out=base if out is None else out).clamp_(-QC, QC)


def encode(master: torch.Tensor, copy: torch.Tensor, out: torch.Tensor, *, block: int) -> None:
    """The owner's side: write into `out` the delta that moves `copy` (one shard's INT8 wire
    bytes) to qwZ's quantization of `master`, and apply it to `copy`, as every holder will."""
    numel, nb = master.numel(), master.numel() // block
    s_old, _, c_data = _views(copy, numel, block)
    s_new, steps, d_data = _views(out, numel, block, delta=True)
    # the padding after the steps: zeros, not stale bytes (sent, and byte comparisons see it)
    out[nb * 5:meta_bytes(numel, block)].zero_()
    for r0, r1 in _chunks(nb, block, master.device):
        shape = (r1 - r0, block)
        # t: qwZ's codes of the master (quantize's arithmetic), in fp32; a non-finite
        # block's are 0 (in range; its scale dequantizes to NaN whatever the codes)
        t = scratch_buffer("qwd_t", shape[0] * block, master.device).view(shape)
        s_new[r0:r1] = sn = round_blocks(_fp32_rows(master.reshape(-1), r0, r1, block), QC, t)
        # t and the moves on the old grid as int16: integers in [-2 qmax, 2 qmax],
        # exact, and half the bytes of fp32 (int8 would wrap)
        c8 = c_data[r0 * block:r1 * block].view(-1, block)
        t16 = _scratch_copy(t, torch.int16, "qwd_t16")
        moves = _scratch_copy(c8, torch.int16, "qwd_m16")
        torch.sub(t16, moves, out=moves)
        moved = absmax_rows(moves)
        # |t - clamp(round(c r))| <= |t - c| + qmax |1 - r| + 1/2 (c, t in range), an integer:
        # under dmax + 1 the formula gives k = 1 and t, as do the moves on the old grid (k = 0);
        # fp32's error in c r is under 1e-5. An unusable scale counts as ratio 0, as in `_base`
        rows = _rows(~(moved + QC * (1 - _ratio(s_old[r0:r1], sn)).abs() <= QD + 0.499))
        k = steps[r0:r1].zero_()
        if rows is not None:  # the formula on the others
            every = isinstance(rows, slice)
            cr = _scratch_copy(c8, torch.float32, "qwd_c") if every else c8[rows].float()
            tr = t if every else t[rows]
            diff, kr = _formula(tr, cr, s_old[r0:r1][rows], sn[rows],
                                scratch_buffer("qwd_d", t.numel(), t.device).view(shape)
                                if every else None)
            # k = 0 also where the formula lands on t (k = 1) and the moves on the old
            # grid fit: the same choice on every path, and each holder's cheap add
            direct = (kr == 1) & (moved[rows] <= QD)
            if every:
                moves.copy_(torch.where(direct.unsqueeze(1), moves, diff, out=diff))
                t16.copy_(tr)
            else:  # the direct rows hold their moves and t already
                moves[rows[~direct]] = diff[~direct].to(torch.int16)
                t16[rows[kr > 1]] = tr[kr > 1].to(torch.int16)  # k = 1 rows: c' = t
            k[rows] = torch.where(direct, 0.0, kr).to(torch.uint8)
        d_data[r0 * block // 2:r1 * block // 2].copy_(pack_int4(moves))
        c8.copy_(t16)
    s_old.copy_(s_new)


def _scratch_copy(x: torch.Tensor, dtype: torch.dtype, slot: str) -> torch.Tensor:
    """x (integers that `dtype` holds exactly) as `dtype`, in a scratch buffer of x's shape."""
    n = x.numel()
    buf = scratch_buffer(slot, -(-n * dtype.itemsize // 4), x.device).view(dtype)[:n]
    return buf.view(x.shape).copy_(x)


def apply(copy: torch.Tensor, delta: torch.Tensor, *, numel: int, block: int) -> None:
    """A holder's side: move `copy` (one shard's INT8 wire bytes) by the owner's delta."""
    s_old, _, c_data = _views(copy, numel, block)
    s_new, steps, d_data = _views(delta, numel, block, delta=True)
    for r0, r1 in _chunks(numel // block, block, copy.device):
        k = steps[r0:r1]
        rows = _rows(k > 0)
        codes = c_data[r0 * block:r1 * block].view(-1, block)
        moves = unpack_int4(d_data[r0 * block // 2:r1 * block // 2]).view(-1, block)
        if rows is not None:  # the rescaled blocks, from their old codes
            base = _base(codes[rows].float(), s_old[r0:r1][rows], s_new[r0:r1][rows])
            far = _far(base, moves[rows].float(), k[rows].unsqueeze(1).float()).to(torch.int8)
        codes.add_(moves)  # k = 0: moves on the old grid, each landing on t
        if isinstance(rows, slice):
            torch.where((k == 0).unsqueeze(1), codes, far, out=codes)
        elif rows is not None:
            codes[rows] = far  # (a view of the copy: moved in place)
    s_old.copy_(s_new)
