"""qWD's owner encode and holder apply as fused torch.compile kernels, against
zeropp.qwd's eager ones: same bytes? faster? (qWD's only form: INT8 copies moved
by INT4 deltas, rounded to nearest.) Each kernel works on every block at
once, as the GPU path of qwd.py does (the note's formula on all blocks, then each
block's own result chosen with `torch.where`); the eager CPU path runs the formula
only on the blocks that need it. The moves are packed and unpacked by quant.py's
eager pack_int4 / unpack_int4 (an int16 pair view does not vectorize in inductor's
C++, and a strided one runs scalar).

Two regimes, as benchmarks/probes/qwd_cost.py: 60 "steady" steps of one 442K-value
shard (weights ~ N(0, 0.02) moved by N(0, 2e-4)), and the first 12 AdamW steps of
gpt-6x384 over four shards' worth of its values ("early"). Medians in ms per call
(one thread); mismatches counts steps where the wire bytes, the owner's copy or a
holder's copy differ from the eager ones.

    python benchmarks/probes/qwd_fused.py
"""
import math
import statistics

import torch
from qwd_cost import _timed

from zeropp import kernels, qwd
from zeropp.quant import pack_int4, quantize, scratch_buffer, unpack_int4
from zeropp.qwd import QC, QD, _ratio, _views
from zeropp.train.model import GPT, PRESETS, GPTConfig

BLOCK, SHARD = 2048, 442368


def _encode(x, c, s_old, moves_out):
    """x (blocks, block) the master, c its INT8 copy's codes (moved in place), s_old
    the copy's scales: returns the new scales and steps, the moves into moves_out."""
    xf = x.float()
    absmax = xf.abs().amax(dim=1, keepdim=True)
    div = kernels._divisor(absmax, QC)  # fp32(absmax / 127), at least 2^-126
    # quant.block_scales(canonical_absmax(absmax)): d, but 0 for a zero block, quiet NaN
    s_new = torch.where(absmax.isnan(), math.nan, torch.where(absmax > 0, div, 0.0))
    t = torch.where(s_new.isfinite(), (xf / div).round(), 0.0)
    cf = c.float()
    moves = t - cf
    moved = moves.abs().amax(dim=1, keepdim=True)
    ratio = _ratio(s_old, s_new)
    formula = ~(moved + QC * (1 - ratio).abs() <= QD + 0.499)
    base = (cf * ratio).round().clamp(-QC, QC)
    diff = t - base
    k = (diff.abs().amax(dim=1, keepdim=True) / QD).ceil().clamp(1, 255)
    far = k > 1
    d = torch.where(far, (diff / k).round(), diff)
    landed = torch.where(far, (base + d * k).clamp(-QC, QC), t)
    direct = (k == 1) & (moved <= QD)
    c.copy_(torch.where(formula, landed, t).to(torch.int8))
    moves_out.copy_(torch.where(formula, torch.where(direct, moves, d), moves).to(torch.int8))
    return s_new, torch.where(formula, torch.where(direct, 0.0, k), 0.0).to(torch.uint8)


def _apply(c, moves, k, s_old, s_new):
    cf, mf = c.float(), moves.float()
    base = (cf * _ratio(s_old, s_new)).round().clamp(-QC, QC)
    far = (base + mf * k.float()).clamp(-QC, QC)
    c.copy_(torch.where(k == 0, cf + mf, far).to(torch.int8))


_ENC = torch.compile(_encode, dynamic=True, options=kernels._OPTIONS)
_APP = torch.compile(_apply, dynamic=True, options=kernels._OPTIONS)


def _delta_views(delta, numel):
    """qwd.py's delta wire format: scales, steps and the packed moves."""
    extra = qwd.meta_bytes(numel, BLOCK) - numel // BLOCK * 4
    return _views(delta, numel, BLOCK, extra)


def encode(master, copy, out):
    numel = master.numel()
    nb = numel // BLOCK
    s_old, _, codes = _views(copy, numel, BLOCK)
    codes = codes.view(torch.int8)
    s_new, steps, data = _delta_views(out, numel)
    out[nb * 5:nb * 4 + qwd.meta_bytes(numel, BLOCK) - nb * 4].zero_()
    data[numel // 2:].zero_()
    moves = scratch_buffer("qwd_fused", numel // 4, master.device).view(torch.int8)
    sn, k = _ENC(master.view(nb, BLOCK), codes.view(nb, BLOCK), s_old.view(nb, 1),
                 moves.view(nb, BLOCK))
    data[:numel // 2].copy_(pack_int4(moves))
    s_new.copy_(sn.view(-1))
    steps.copy_(k.view(-1))
    s_old.copy_(s_new)


def apply(copy, delta, numel):
    nb = numel // BLOCK
    s_old, _, codes = _views(copy, numel, BLOCK)
    codes = codes.view(torch.int8)
    s_new, steps, data = _delta_views(delta, numel)
    _APP(codes.view(nb, BLOCK), unpack_int4(data[:numel // 2]).view(nb, BLOCK),
         steps.view(nb, 1), s_old.view(nb, 1), s_new.view(nb, 1))
    s_old.copy_(s_new)


def compare(name, masters):
    n = masters[0].numel()
    kw = dict(block=BLOCK)
    own_e = quantize(masters[0], 8, BLOCK).to_bytes().clone()
    own_c, hold_e, hold_c = own_e.clone(), own_e.clone(), own_e.clone()
    out_e = torch.empty(qwd.wire_bytes(n, BLOCK), dtype=torch.uint8)
    out_c = out_e.clone()
    t = {k: [] for k in ("enc_e", "enc_c", "app_e", "app_c")}
    bad = 0
    for m in masters[1:]:
        t["enc_e"].append(_timed(qwd.encode, m, own_e, out_e, **kw))
        t["enc_c"].append(_timed(encode, m, own_c, out_c))
        t["app_e"].append(_timed(qwd.apply, hold_e, out_e, numel=n, **kw))
        t["app_c"].append(_timed(apply, hold_c, out_c, n))
        bad += not (torch.equal(out_e, out_c) and torch.equal(own_e, own_c)
                    and torch.equal(hold_c, own_c) and torch.equal(hold_e, own_e))
    med = {k: statistics.median(v[2:]) for k, v in t.items()}  # past the compiles
    print(f"| {name} | {len(masters) - 1} | {n:,} | {bad} | {med['enc_e']:.3f} | "
          f"{med['enc_c']:.3f} | {med['app_e']:.3f} | {med['app_c']:.3f} |", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    print("| regime | steps | values | mismatches | encode eager | encode fused | "
          "apply eager | apply fused |\n|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    m = torch.randn(SHARD, generator=g) * 0.02
    steady = [m.clone()]
    for _ in range(60):
        m = m + torch.randn(SHARD, generator=g) * 2e-4
        steady.append(m.clone())
    compare("steady", steady)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, **PRESETS["gpt-6x384"]))
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    early = []
    for i in range(13):
        if i:
            x = torch.randint(0, 256, (2, 64), generator=g)
            opt.zero_grad()
            model(x, x)[1].backward()
            opt.step()
        early.append(torch.cat([p.detach().reshape(-1) for p in params])[:4 * SHARD].clone())
    compare("early", early)


if __name__ == "__main__":
    main()
