"""qWD's encode + apply on a GPU with and without host syncs (run on a CUDA device).

The CPU path finds the blocks whose moves on the old grid do not fit (`nonzero`,
`any`: each a host sync); the device path sends every block through both formulas
and keeps each block's own, the same bits, no sync (qwd.py). Alone on an idle GPU a
sync costs little; in training the GPU has work
queued (the forward's kernels), and a sync blocks the host until all of it is done,
so the next kernels are not queued meanwhile. Measured both ways, per 442K-value
shard (gpt-6x384 at 2x2), best of 20:
  alone     encode + apply, synchronized before and after
  queued    host time of encode + apply issued behind ~20 ms of matrix products
            (how long the host is held up before it can queue the next kernels)

    python benchmarks/probes/qwd_sync_probe.py
"""
import time

import torch

from zeropp import qwd
from zeropp.quant import quantize


def cpu_rule(need: torch.Tensor):
    """The CPU's choice of rows, on the device: a sync per call."""
    rows = need.nonzero().squeeze(1)
    return None if not len(rows) else slice(None) if 2 * len(rows) > len(need) else rows


def main() -> None:
    n, block, dev = 442368, 2048, "cuda"
    g = torch.Generator().manual_seed(0)
    m = (torch.randn(n, generator=g) * 0.02).to(dev)
    m2 = m + (torch.randn(n, generator=g) * 2e-4).to(dev)
    copy = quantize(m, 8, block).to_bytes().clone()
    out = torch.empty(qwd.wire_bytes(n, block), dtype=torch.uint8, device=dev)
    a = torch.randn(4096, 4096, device=dev)

    def step():
        c = copy.clone()
        qwd.encode(m2, c, out, block=block)
        qwd.apply(copy.clone(), out, numel=n, block=block)

    device_rule = qwd._rows
    for name, rule in (("device path (no sync)", device_rule), ("CPU rule (syncs)", cpu_rule)):
        qwd._rows = rule
        step()
        torch.cuda.synchronize()
        alone, queued = [], []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            alone.append(time.perf_counter() - t0)
            for _ in range(8):  # ~20 ms of work ahead of the encode
                a @ a
            t0 = time.perf_counter()
            step()
            queued.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        print(f"{name}: alone {min(alone) * 1e3:.3f} ms, host held behind queued work "
              f"{min(queued) * 1e3:.3f} ms (median {sorted(queued)[10] * 1e3:.3f})", flush=True)
    qwd._rows = device_rule


if __name__ == "__main__":
    main()
