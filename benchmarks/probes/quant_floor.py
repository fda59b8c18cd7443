"""How close INT8 quantize + dequantize can come to copy_ on this CPU: beside copy_
and the codecs (eager, and compiled as zeropp.kernels runs them), kernels compiled
the same way that do only memory traffic, with no arithmetic a codec could drop.
Two floors from them:
- read + write: the quantize's read (each block's max |x| of a 64 MiB fp32 tensor)
  plus the dequantize's write (each block's scale broadcast into a 64 MiB fp32
  output), leaving out the 16 MiB of codes each half also moves;
- both halves' traffic: fp32 -> int8 and int8 -> fp32 conversions, the exact bytes
  of quantize and of dequantize, with a type conversion for all their arithmetic.
copy_ / floor is then the most "vs copy_" a codec could show with ordinary stores.
Every op from a cold cache (96 MiB read first), the ops taking turns, min and
median over the rounds, as benchmarks/quant.py times them.

    python benchmarks/probes/quant_floor.py [--rounds N]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: quant.py
from quant import _mode, rounds  # noqa: E402  (its timing, cold and taking turns)

from zeropp import kernels  # noqa: E402
from zeropp.quant import dequantize, quantize  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args()
    rows, block = 8192, 2048
    x = torch.randn(rows, block)
    dst, out = torch.empty_like(x), torch.empty_like(x)
    q = quantize(x.view(-1), 8, block)
    wire = torch.empty_like(q.to_bytes())
    scales = q.scales.view(rows, 1).clone()
    compile_ = lambda f: torch.compile(f, dynamic=True, options=kernels._OPTIONS)  # noqa: E731
    read = compile_(lambda t: t.abs().amax(dim=1, keepdim=True))
    write = compile_(lambda s, o: o.copy_(s.expand(-1, block) * 1.0))
    # each half's traffic, with a conversion for all its arithmetic
    q_traffic = compile_(lambda t, c: c.copy_(t.to(torch.int8)))
    dq_traffic = compile_(lambda c, o: o.copy_(c.float()))
    dq_kernel = compile_(lambda c, s, o: o.copy_(c.float() * s))
    codes = q.data.view(rows, block)
    codes_out = torch.empty_like(codes)

    def codec(mode: str, f):
        return lambda: (_mode(mode), f())
    ops = {"copy_ (read 64 MiB, write 64 MiB)": lambda: dst.copy_(x),
           "floor of quantize: read 64 MiB (max |x| per block)": lambda: read(x),
           "floor of dequantize: write 64 MiB (scale per block)": lambda: write(scales, out),
           "quantize's traffic: read 64 MiB, write 16 MiB (values as int8)":
           lambda: q_traffic(x, codes_out),
           "dequantize's traffic: read 16 MiB, write 64 MiB (codes as fp32)":
           lambda: dq_traffic(codes, out),
           "INT8 quantize into out, eager": codec("eager", lambda: quantize(x.view(-1), 8, block, out=wire)),
           "INT8 quantize into out, compiled": codec("compiled", lambda: quantize(x.view(-1), 8, block, out=wire)),
           "INT8 dequantize into out, eager": codec("eager", lambda: dequantize(q, out=out.view(-1))),
           "INT8 dequantize into out, one compiled kernel (codes * scale)":
           lambda: dq_kernel(codes, scales, out)}
    ts = rounds(ops, a.rounds)
    _mode("default")
    lo = {k: v[0] for k, v in ts.items()}
    copy_ms = lo["copy_ (read 64 MiB, write 64 MiB)"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.rounds} rounds, cold\n")
    print("| operation | min ms | median ms | vs copy_ (min) |\n|---|---|---|---|")
    for k, (least, median) in ts.items():
        print(f"| {k} | {least:.2f} | {median:.2f} | {copy_ms / least:.0%} |")
    floor = lo["floor of quantize: read 64 MiB (max |x| per block)"] + \
        lo["floor of dequantize: write 64 MiB (scale per block)"]
    best = lo["INT8 quantize into out, compiled"] + lo["INT8 dequantize into out, eager"]
    print(f"| **floor: read + write** | {floor:.2f} | | {copy_ms / floor:.0%} |")
    traffic = lo["quantize's traffic: read 64 MiB, write 16 MiB (values as int8)"] + \
        lo["dequantize's traffic: read 16 MiB, write 64 MiB (codes as fp32)"]
    print(f"| **floor: both halves' traffic (conversions only)** | {traffic:.2f} | | "
          f"{copy_ms / traffic:.0%} |")

    print(f"| **INT8 quantize (compiled) + dequantize (eager), as zeropp runs them** | "
          f"{best:.2f} | | {copy_ms / best:.0%} |")
    fused = lo["INT8 quantize into out, compiled"] + \
        lo["INT8 dequantize into out, one compiled kernel (codes * scale)"]
    print(f"| **INT8 quantize (compiled) + dequantize (one compiled kernel)** | {fused:.2f} | | "
          f"{copy_ms / fused:.0%} |")


if __name__ == "__main__":
    main()
