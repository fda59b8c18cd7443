"""zeropp.quant: accuracy table and CPU throughput next to copy_ bandwidth.

    python benchmarks/quant.py [--write]

Accuracy: relative L2 error ||x - dq(q(x))|| / ||x|| on 1M Gaussian values.
Speed: a 64 MiB fp32 tensor (16M values), best of 7 runs after a warm-up, eager
and compiled (zeropp/kernels.py) codecs:
quantize + dequantize into preallocated outputs (the engine keeps persistent
send and full-weight buffers) against `copy_` into a preallocated tensor, so
both write into memory that is already mapped: like for like. With fresh
outputs too: on this machine the page faults of a new 64 MiB buffer cost
more than the arithmetic, for `clone` as for quantization.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from _report import report

from zeropp import kernels
from zeropp.quant import dequantize, quantize, rotate, unrotate


def _mode(mode: str) -> None:
    """eager, compiled (at every size) or default (compiled from kernels.MIN_NUMEL)."""
    import os
    os.environ["ZEROPP_COMPILE"] = "0" if mode == "eager" else "1"
    kernels.MIN_NUMEL = 0 if mode == "compiled" else _DEFAULT_MIN


_DEFAULT_MIN = kernels.MIN_NUMEL

BLOCKS = [64, 256, 1024, 2048, 4096]


def rel_err(x, bits, block, rot, stoch):
    g = torch.Generator().manual_seed(0)
    y = rotate(x, 1, block) if rot else x
    d = dequantize(quantize(y, bits, block, stochastic=stoch, generator=g))
    back = unrotate(d, 1, block, x.shape) if rot else d
    return ((back - x).norm() / x.norm()).item()


def best_ms(f, n=7):
    f()
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    lines = [f"### Quantization: accuracy and CPU speed ({time.strftime('%Y-%m-%d')})", "",
             f"Command: `python benchmarks/quant.py {' '.join(sys.argv[1:])}`  ",
             f"torch {torch.__version__}, {torch.get_num_threads()} threads.", "",
             "Relative L2 error on 1M standard-normal values (RNE = round to nearest even, "
             "SR = stochastic rounding, +H = randomized Hadamard rotation per block):", "",
             "| bits | block | RNE | RNE+H | SR | SR+H |", "|---|---|---|---|---|---|"]
    for bits in (8, 4):
        for b in BLOCKS:
            errs = [rel_err(x, bits, b, rot, st) for st in (False, True) for rot in (False, True)]
            lines.append(f"| {bits} | {b} | " + " | ".join(f"{e:.4f}" for e in errs) + " |")
    big = torch.randn(16 << 20)
    mb = big.numel() * 4 / 1e6
    dst = torch.empty_like(big)
    copy_ms = best_ms(lambda: dst.copy_(big))
    clone_ms = best_ms(lambda: big.clone())
    lines += ["", f"Throughput on a 64 MiB ({mb:.1f} MB) fp32 tensor (GB/s of fp32 input; best of 7):",
              "", "| operation | ms | GB/s | vs copy_ |", "|---|---|---|---|",
              f"| copy_ into preallocated | {copy_ms:.1f} | {mb / copy_ms:.2f} | 100% |",
              f"| clone (fresh output) | {clone_ms:.1f} | {mb / clone_ms:.2f} | "
              f"{copy_ms / clone_ms:.0%} |"]
    for mode in ("eager", "compiled"):
        _mode(mode)
        for bits in (8, 4):
            q = quantize(big, bits, 2048)
            wire = torch.empty_like(q.to_bytes())
            q_fresh = best_ms(lambda: quantize(big, bits, 2048))  # noqa: B023
            q_ms = best_ms(lambda: quantize(big, bits, 2048, out=wire))  # noqa: B023
            dq_ms = best_ms(lambda: dequantize(q, out=dst))  # noqa: B023
            dq_fresh = best_ms(lambda: dequantize(q))  # noqa: B023
            for name, ms in [(f"INT{bits} quantize, fresh output", q_fresh),
                             (f"INT{bits} dequantize, fresh output", dq_fresh),
                             (f"INT{bits} quantize into out", q_ms),
                             (f"INT{bits} dequantize into out", dq_ms),
                             (f"**INT{bits} quantize + dequantize, into out**", q_ms + dq_ms),
                             (f"INT{bits} quantize + dequantize, fresh outputs",
                              q_fresh + dq_fresh)]:
                lines.append(f"| {mode}: {name} (block 2048) | {ms:.1f} | {mb / ms:.2f} | "
                             f"{copy_ms / ms:.0%} |")
    lines += ["", "By size (INT8 quantize + dequantize into preallocated outputs, block "
              "2048, ms, best of 7): where the compiled kernels start to pay "
              "(`zeropp.kernels.MIN_NUMEL`).", "",
              "| values | eager | compiled | compiled / eager |", "|---|---|---|---|"]
    for n in (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22):
        x = torch.randn(n)
        ms = {}
        for mode in ("eager", "compiled"):
            _mode(mode)
            q = quantize(x, 8, 2048)
            wire, out = torch.empty_like(q.to_bytes()), torch.empty_like(x)
            ms[mode] = (best_ms(lambda: quantize(x, 8, 2048, out=wire))  # noqa: B023
                        + best_ms(lambda: dequantize(q, out=out)))  # noqa: B023
        lines.append(f"| {n:,} | {ms['eager']:.3f} | {ms['compiled']:.3f} | "
                     f"{ms['compiled'] / ms['eager']:.2f} |")
    _mode("default")
    lines += ["", "eager: vectorized torch ops over cache-sized (4 MiB) chunks of blocks; "
              "compiled: quantize as one fused torch.compile kernel (zeropp/kernels.py), "
              "bitwise equal (tests/test_kernels.py), compiled once per process before "
              "the timing; dequantize is eager in both. Run-to-run noise on this shared 2-core machine is about 20%.", ""]
    report(lines, a.write)


if __name__ == "__main__":
    main()
