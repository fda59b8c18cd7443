"""qWD's CPU cost per 442K-value shard (one gpt-6x384 block's shard at 2 x 2), single
process, one thread: the owner's `qwd.encode` and a holder's `qwd.apply`, beside qwZ's
INT8 `quantize` of the same shard (what ZeRO++'s forward does instead), in two regimes:

  steady   weights ~ N(0, 0.02) moved by N(0, 2e-4) per step (AdamW late in training:
           nearly every block's codes move by a few steps), 300 steps
  early    the first 12 AdamW steps (lr 1e-3) of gpt-6x384 from its initialization,
           the regime of paired_step.py and cpu_attribution.py (zeropp bench's lr is
           1e-4): every weight moves by about the lr, so a third of the blocks need
           their old codes rescaled, a few percent move farther (k > 1)

Compare two trees by running it under each: `PYTHONPATH=<tree>/src python
benchmarks/probes/qwd_cost.py`. Timings are medians of the steps (steady) or totals over
the steps (early), in ms per shard and step.

    python benchmarks/probes/qwd_cost.py
"""
import statistics
import time

import torch

from zeropp import qwd
from zeropp.quant import quantize
from zeropp.train.model import GPT, PRESETS, GPTConfig

BLOCK, SHARD = 2048, 442368


def _timed(f, *args, **kwargs) -> float:
    t = time.perf_counter()
    f(*args, **kwargs)
    return (time.perf_counter() - t) * 1e3


def steady() -> tuple[float, float, float]:
    g = torch.Generator().manual_seed(0)
    m = torch.randn(SHARD, generator=g) * 0.02
    owner = quantize(m, 8, BLOCK).to_bytes().clone()
    holder = owner.clone()
    out = torch.empty(qwd.wire_bytes(SHARD, BLOCK), dtype=torch.uint8)
    moves = [torch.randn(SHARD, generator=g) * 2e-4 for _ in range(4)]
    enc, app, qz = [], [], []
    for i in range(300):
        m.add_(moves[i % 4])
        enc.append(_timed(qwd.encode, m, owner, out, block=BLOCK))
        app.append(_timed(qwd.apply, holder, out, numel=SHARD, block=BLOCK))
        qz.append(_timed(quantize, m, 8, BLOCK))
    assert torch.equal(owner, holder)
    return statistics.median(enc), statistics.median(app), statistics.median(qz)


def early(steps: int = 12) -> tuple[float, float, float]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, **PRESETS["gpt-6x384"]))
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    n = 4 * SHARD  # the first four shards' worth of the model's values

    def shard() -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in params])[:n].clone()

    owner = quantize(shard(), 8, BLOCK).to_bytes().clone()
    holder = owner.clone()
    out = torch.empty(qwd.wire_bytes(n, BLOCK), dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    enc = app = qz = 0.0
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 64), generator=g)
        opt.zero_grad()
        model(x, x)[1].backward()
        opt.step()
        m = shard()
        enc += _timed(qwd.encode, m, owner, out, block=BLOCK)
        app += _timed(qwd.apply, holder, out, numel=n, block=BLOCK)
        qz += _timed(quantize, m, 8, BLOCK)
    assert torch.equal(owner, holder)
    per = steps * n / SHARD
    return enc / per, app / per, qz / per


def main() -> None:
    torch.set_num_threads(1)
    print("| regime | encode ms | apply ms | encode + apply ms | qwZ quantize ms |")
    print("|---|---|---|---|---|")
    for name, f in (("steady", steady), ("early", early)):
        e, a, q = f()
        print(f"| {name} | {e:.3f} | {a:.3f} | {e + a:.3f} | {q:.3f} |", flush=True)


if __name__ == "__main__":
    main()
