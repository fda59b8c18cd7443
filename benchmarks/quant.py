"""zeropp.quant: accuracy table and CPU throughput next to copy_ bandwidth.

    python benchmarks/quant.py [--rounds N] [--write]

Accuracy: relative L2 error ||x - dq(q(x))|| / ||x|| on 1M Gaussian values.
Speed: a 64 MiB fp32 tensor (16M values), block 2048, eager and compiled
(zeropp/kernels.py) codecs, quantize and dequantize into preallocated outputs (the
engine keeps persistent send and full-weight buffers) against `copy_` into a
preallocated tensor: like for like. Every operation starts from a cold cache (a
96 MiB read first: the L3 here is 32 MiB and would otherwise hold part of the
previous operation's output, which favoured whichever ran after a writer of the
same buffer by up to 40%), and the operations take turns, round by round, so
that the machine's slow and fast spells fall on all of them; min and median over
the rounds. With fresh outputs too: on this machine the page faults of a new
64 MiB buffer cost more than the arithmetic, for `clone` as for quantization.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from _report import report

from zeropp import kernels
from zeropp.quant import dequantize, quantize


def _mode(mode: str) -> None:
    """eager, compiled (at every size) or default (compiled from kernels.MIN_NUMEL)."""
    os.environ["ZEROPP_COMPILE"] = "0" if mode == "eager" else "1"
    kernels.MIN_NUMEL = dict.fromkeys(_DEFAULT_MIN, 0) if mode == "compiled" else _DEFAULT_MIN


_DEFAULT_MIN = kernels.MIN_NUMEL
_FLUSH = torch.ones(24 << 20)  # 96 MiB


def _eager(mode: str, bits: int, out: str) -> str:
    """' (eager ops)' where the compiled mode has no kernel for this dequantize."""
    dtype = torch.float32 if out == "f" else torch.bfloat16
    return " (eager ops)" if mode == "compiled" and not kernels.compiles_dequantize(bits, dtype) else ""


def rounds(ops: dict, n: int) -> dict:
    """{name: (min ms, median ms)} of each op over n rounds, every call cold."""
    for f in ops.values():
        f()  # warm-up: compiles, page faults of the outputs
    times: dict = {k: [] for k in ops}
    for _ in range(n):
        for k, f in ops.items():
            _FLUSH.sum()
            t0 = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: (min(v), statistics.median(v)) for k, v in times.items()}


BLOCKS = [64, 256, 1024, 2048, 4096]


def rel_err(x, bits, block):
    return ((dequantize(quantize(x, bits, block)) - x).norm() / x.norm()).item()


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
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args()
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    lines = [f"### Quantization: accuracy and CPU speed ({time.strftime('%Y-%m-%d')})", "",
             f"Command: `python benchmarks/quant.py {' '.join(sys.argv[1:])}`  ",
             f"torch {torch.__version__}, {torch.get_num_threads()} threads.", "",
             "Relative L2 error on 1M standard-normal values (round to nearest, ties to "
             "even):", "",
             "| bits | block | rel. L2 error |", "|---|---|---|"]
    for bits in (8, 4):
        for b in BLOCKS:
            lines.append(f"| {bits} | {b} | {rel_err(x, bits, b):.4f} |")
    big = torch.randn(16 << 20)
    mb = big.numel() * 4 / 1e6
    dst, dst16 = torch.empty_like(big), torch.empty_like(big, dtype=torch.bfloat16)
    ops = {"copy_ into preallocated": lambda: dst.copy_(big), "clone (fresh output)": big.clone}
    for mode in ("eager", "compiled"):
        for bits in (8, 4):
            q = quantize(big, bits, 2048)
            wire = torch.empty_like(q.to_bytes())

            def run(f, mode=mode):
                return lambda: (_mode(mode), f())
            ops |= {f"{mode}: INT{bits} quantize, fresh output":
                    run(lambda bits=bits: quantize(big, bits, 2048)),
                    f"{mode}: INT{bits} quantize into out":
                    run(lambda bits=bits, wire=wire: quantize(big, bits, 2048, out=wire)),
                    f"{mode}: INT{bits} dequantize, fresh output{_eager(mode, bits, 'f')}":
                    run(lambda q=q: dequantize(q)),
                    f"{mode}: INT{bits} dequantize into out{_eager(mode, bits, 'f')}":
                    run(lambda q=q: dequantize(q, out=dst)),
                    f"{mode}: INT{bits} dequantize into a bf16 out{_eager(mode, bits, 'b')}":
                    run(lambda q=q: dequantize(q, out=dst16))}
    t = rounds(ops, a.rounds)
    copy_ms = t["copy_ into preallocated"][0]
    lines += ["", f"Throughput on a 64 MiB ({mb:.1f} MB) fp32 tensor, block 2048, every operation "
              f"from a cold cache, {a.rounds} rounds taking turns (GB/s of fp32 input, from the "
              "min; vs copy_ from the min):", "",
              "| operation | min ms | median ms | GB/s | vs copy_ |", "|---|---|---|---|---|"]

    def row(name, ms, med):
        lines.append(f"| {name} | {ms:.2f} | {med:.2f} | {mb / ms:.2f} | {copy_ms / ms:.0%} |")
    for name, (ms, med) in t.items():
        row(name, ms, med)
    for mode in ("eager", "compiled"):
        for bits in (8, 4):
            for out in ("into out", "fresh output"):
                qn = f"{mode}: INT{bits} quantize{',' if out[0] == 'f' else ''} {out}"
                dn = (f"{mode}: INT{bits} dequantize{',' if out[0] == 'f' else ''} {out}"
                      f"{_eager(mode, bits, 'f')}")
                pair = [t[qn][k] + t[dn][k] for k in (0, 1)]
                row(f"**{mode}: INT{bits} quantize + dequantize, {out}**"
                    f"{_eager(mode, bits, 'f').replace('(', '(dequantize: ')}", *pair)
    lines += ["", "By size (quantize + dequantize into preallocated outputs, block 2048, "
              "fp32, ms, best of 7, warm: the sizes of a unit's pieces): where the compiled "
              "kernels start to pay (`zeropp.kernels.MIN_NUMEL`).", "",
              "| values | INT8 eager | INT8 compiled | compiled / eager | INT4 eager | "
              "INT4 compiled | compiled / eager |", "|---|---|---|---|---|---|---|"]
    for n in (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 21, 1 << 22):
        x = torch.randn(n)
        cells = []
        for bits in (8, 4):
            ms = {}
            for mode in ("eager", "compiled"):
                _mode(mode)
                q = quantize(x, bits, 2048)
                wire, out = torch.empty_like(q.to_bytes()), torch.empty_like(x)
                ms[mode] = (best_ms(lambda: quantize(x, bits, 2048, out=wire))  # noqa: B023
                            + best_ms(lambda: dequantize(q, out=out)))  # noqa: B023
            cells += [f"{ms['eager']:.3f}", f"{ms['compiled']:.3f}",
                      f"{ms['compiled'] / ms['eager']:.2f}"]
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    _mode("default")
    lines += ["", "eager: vectorized torch ops over cache-sized (4 MiB) chunks of blocks; "
              "compiled: quantize and dequantize each one fused torch.compile kernel "
              "(zeropp/kernels.py), "
              "bitwise equal (tests/comm/test_kernels.py), compiled once per process before "
              "the timing; INT8 dequantize into fp32 runs the eager ops in both (faster at a "
              "unit's sizes, kernels.py). Run-to-run noise on this shared 2-core machine is "
              "about 20%.", ""]
    report(lines, a.write)


if __name__ == "__main__":
    main()
