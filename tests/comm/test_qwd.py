"""qWD's code deltas (qwd.py), single process: the owner's and a holder's copies stay
bitwise equal, and land on qwZ's INT8 of the master exactly when no code moved far."""

import pytest
import torch

from zeropp import qwd
from zeropp.quant import QTensor, quantize

BLOCK, NB = 64, 12
NUMEL = BLOCK * NB


def _codes(wire: torch.Tensor) -> QTensor:
    return QTensor.from_bytes(wire, (NUMEL,), torch.float32, 8, BLOCK)


def _master() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    m = torch.randn(NB, BLOCK, generator=g) * torch.logspace(-4, 0, NB).unsqueeze(1)
    m[3] = 0.0          # an all-zero block (scale 0) that starts moving
    m[5] = 1.0          # LayerNorm-like: every value equal
    return m.view(-1)


def _walk(steps: int):
    """Owner and holder copies through `steps` updates. Each weight moves by about
    1e-3 (as AdamW moves every weight by about its lr): two INT8 steps of the
    larger blocks, hundreds of the smallest ones'; at step 10 block 9's values reverse
    their order, which moves its codes by up to twice their range (a block that only
    grows, say tenfold, keeps its codes: its scale grows with it)."""
    g = torch.Generator().manual_seed(1)
    m = _master()
    owner = quantize(m, 8, BLOCK).to_bytes().clone()
    holder = owner.clone()
    out = []
    for step in range(steps):
        m = m + torch.randn(NUMEL, generator=g) * 1e-3
        if step == 10:
            m.view(NB, BLOCK)[9] = m.view(NB, BLOCK)[9].flip(0)
        delta = torch.empty(qwd.wire_bytes(NUMEL, BLOCK), dtype=torch.uint8)
        qwd.encode(m, owner, delta, block=BLOCK)
        qwd.apply(holder, delta, numel=NUMEL, block=BLOCK)
        out.append((m.clone(), owner.clone(), holder.clone(), delta[NB * 4:NB * 5].int(),
                    delta.clone()))
    return out


def _large(m: torch.Tensor) -> torch.Tensor:
    """Blocks whose INT8 step is over 1e-3 (absmax > 0.127): INT4 moves of ~1e-3 (up
    to ~3 sigma over a block) then fit."""
    return m.view(NB, BLOCK).abs().amax(1) > 0.127


def _device_path(monkeypatch) -> None:
    """What a CUDA shard runs, here: every block through the rescaled formula, the
    direct ones chosen back (finding the rescaled blocks would sync the host)."""
    monkeypatch.setattr(qwd, "_rows", lambda mask: slice(None))


@pytest.mark.parametrize("path", ["cpu", "device"])
def test_holder_and_owner_copies_are_bitwise_equal_and_land_on_qwz_int8(path, monkeypatch):
    """Exact (k <= 1) where every code moved by at most 7 (an INT4 move)."""
    if path == "device":
        _device_path(monkeypatch)
    large, misses = 0, []
    for step, (m, owner, holder, ks, _) in enumerate(_walk(30)):
        assert torch.equal(owner, holder), step
        qwz, mine = quantize(m, 8, BLOCK), _codes(owner)
        assert torch.equal(mine.scales, qwz.scales)  # the copy's scales are qwZ's, always
        off = (mine.data.view(NB, BLOCK).int() - qwz.data.view(NB, BLOCK).int()).abs()
        off = off.amax(1)
        k = ks.int()
        # k = 0 (every code moved by <= 7 on the old grid) or 1 (by <= 7 once the old codes
        # are rescaled): the copy is qwZ's INT8, bit for bit; else within half a step,
        # the rest sent later
        assert bool((off[k <= 1] == 0).all()), (step, off, k)
        assert bool((off <= (k // 2).clamp(min=0)).all()), (step, off, k)
        big = _large(m)
        large += int(big.sum())
        misses += [(step, int(i)) for i in ((off > 0) & big).nonzero().view(-1)]
    # the blocks of weights larger than the moves are exact on every step but while
    # block 9's reversal (step 10) arrives: over two deltas (k = 24 lands within 12
    # codes, then k = 2 within one)
    assert large >= 30 * 4, large
    assert all(i == 9 and 10 <= step < 12 for step, i in misses), misses


def test_the_device_path_sends_and_keeps_the_same_bytes_as_the_cpu_path(monkeypatch):
    """The sync-free path (all blocks through both formulas) gives the CPU path's
    deltas (scales, steps, moves) and copies bit for bit, over 30 steps and a jump."""
    cpu = _walk(30)
    _device_path(monkeypatch)
    for step, (a, b) in enumerate(zip(cpu, _walk(30))):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), step


def test_a_far_move_is_carried_into_the_next_deltas_not_lost():
    walk = _walk(14)
    ks = [int(x[3][9]) for x in walk]
    assert ks[10] > 1 and ks[12] <= 1 and ks[13] <= 1, ks  # caught up within two steps
    m, owner, *_ = walk[13]
    assert torch.equal(_codes(owner).data.view(NB, BLOCK)[9],
                       quantize(m, 8, BLOCK).data.view(NB, BLOCK)[9])


def test_delta_costs_half_of_qwz_int8_bytes_plus_one_byte_per_block():
    n, block = 2048 * 8, 2048
    int8 = QTensor.wire_bytes(n, 8, block)
    assert qwd.wire_bytes(n, block) == n // 2 + 8 * 4 + 8
    assert qwd.wire_bytes(n, block) / int8 == pytest.approx(0.5, abs=0.002)
    assert qwd.meta_bytes(n, block) == 8 * 4 + 8


def _rescaled_everywhere(m: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
    """The formula of qwd.py's note on every block (no k = 0 shortcut), written out:
    the copy it leaves."""
    dmax = 7
    old, new = _codes(copy), quantize(m, 8, BLOCK)
    c, t = old.data.view(NB, BLOCK).float(), new.data.view(NB, BLOCK).float()
    ratio = old.scales / new.scales
    ratio = torch.where((new.scales > 0) & ratio.isfinite(), ratio, 0.0).unsqueeze(1)
    base = (c * ratio).round().clamp(-127, 127)
    diff = t - base
    k = (diff.abs().amax(1, keepdim=True) / dmax).ceil().clamp(1, 255)
    codes = (base + (diff / k).round() * k).clamp(-127, 127)
    return QTensor(codes.to(torch.int8).view(-1), new.scales, (NUMEL,), torch.float32, 8,
                   BLOCK).to_bytes()


def test_moves_on_the_old_grid_change_no_bits_and_take_most_large_blocks():
    """k = 0 (d = t - c, no rescaling) only where the formula would give k = 1 and t:
    the copies are bitwise those of the formula on every block, at every step of a
    walk with a reversal; and most blocks of weights larger than the moves take it."""
    walk = _walk(30)
    prev = quantize(_master(), 8, BLOCK).to_bytes()
    direct = large = 0
    for step, (m, owner, _, ks, _) in enumerate(walk):
        assert torch.equal(owner, _rescaled_everywhere(m, prev)), step
        big = _large(m)
        direct += int((ks[big] == 0).sum())
        large += int(big.sum())
        prev = owner
    assert direct >= 0.8 * large, (direct, large)


@pytest.mark.parametrize("path", ["cpu", "device"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_master_keeps_holders_equal_and_they_recover(bad, path, monkeypatch):
    """One step with a NaN or inf weight (its block's scale is then non-finite), then
    finite again: the holder's copy equals the owner's at every step (codes and
    scales), and both are qwZ's INT8 of the master once it has been finite for a few
    steps. Before, the NaN block took k = 0 and its moves converted to 0, so the
    holder kept its codes while the owner stored others."""
    if path == "device":
        _device_path(monkeypatch)
    g = torch.Generator().manual_seed(0)
    m0 = torch.randn(NUMEL, generator=g) * 0.02
    owner = quantize(m0, 8, BLOCK).to_bytes().clone()
    holder = owner.clone()
    for step in range(6):
        m = m0 + 1e-4 * (step + 1)
        if step == 0:
            m[5] = bad
        delta = torch.zeros(qwd.wire_bytes(NUMEL, BLOCK), dtype=torch.uint8)
        qwd.encode(m, owner, delta, block=BLOCK)
        qwd.apply(holder, delta, numel=NUMEL, block=BLOCK)
        assert torch.equal(owner, holder), step
    assert torch.equal(owner, quantize(m, 8, BLOCK).to_bytes())


def test_the_delta_buffers_padding_is_zeros_not_the_buffers_old_bytes():
    """3 blocks of 8 values: the steps take 3 bytes (padded to 4) and the INT4 moves
    12 (no padding); a buffer full of 0xFF before the encode holds zeros in the
    padding after, so nothing the process held before travels to other ranks."""
    numel, block = 24, 8
    m = torch.linspace(-1, 1, numel)
    copy = quantize(m, 8, block).to_bytes().clone()
    out = torch.full((qwd.wire_bytes(numel, block),), 255, dtype=torch.uint8)
    qwd.encode(m + 0.01, copy, out, block=block)
    nb, data = numel // block, numel // 2
    assert out[nb * 4 + nb:nb * 4 + 4].tolist() == [0]           # after the 3 steps
    assert out.numel() == nb * 4 + 4 + data                      # the moves end it
