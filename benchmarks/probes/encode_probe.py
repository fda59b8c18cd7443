"""Single-process timings of the quantization paths on one unit-sized tensor
(1.8M values: one gpt-6x384 block), with the glibc setting the engine makes
(mmap threshold pinned at 1 MiB, zeropp.host_memory): error feedback's encode of
an inter-node hop (2 rows, one sent) and INT8 / INT4 quantize. Median of 40.

Then what a sender gains from `quantize(..., dequantized=)` (the values the
receiver decodes, from the rounded values in cache) over unpacking its own
bytes, on one rank's share of a unit at 2 x 2 (442K values): error feedback's
encode, and qWD's owner in its exact-copy form, since retired from the library (an
INT4 delta of the values, then its own piece and one received piece applied to the
copies). The two ways alternate, 300 times each, so the
machine's drift touches both alike; medians.

    python benchmarks/probes/encode_probe.py
"""
import statistics
import time

import torch

from zeropp.grads.qgz import HopCodec, _encode
from zeropp.host_memory import release_freed_host_memory
from zeropp.quant import QTensor, dequantize, quantize, scratch_buffer

BLOCK = 2048


def median_ms(fn, n: int = 40) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3


def error_feedback(x: torch.Tensor, residual: torch.Tensor, send: torch.Tensor,
                   fused: bool) -> None:
    """HopCodec.encode's error-feedback pass for one row (the residual kept at zero)."""
    s = torch.add(x, residual, out=scratch_buffer("ef_x", x.numel(), x.device))
    seen = scratch_buffer("ef_dq", x.numel(), x.device)
    if fused:
        quantize(s, 4, BLOCK, out=send, dequantized=seen)
    else:
        dequantize(quantize(s, 4, BLOCK, out=send), out=seen)
    residual.mul_(0.8).add_(s.sub_(seen), alpha=0.2).zero_()


def delta(master: torch.Tensor, copies: torch.Tensor, fused: bool) -> None:
    """The retired exact-copy qWD owner's arithmetic for 2 pieces (its own and one
    received; the deltas are multiplied by 0 so the copies stay put)."""
    n = master.numel()
    diff = torch.sub(master, copies[0], out=scratch_buffer("delta", n, master.device))
    own = scratch_buffer("delta_own", n, master.device)
    if fused:
        send = quantize(diff, 4, BLOCK, dequantized=own).to_bytes()
    else:
        send = quantize(diff, 4, BLOCK).to_bytes()
        dequantize(QTensor.from_bytes(send, (n,), torch.float32, 4, BLOCK), out=own)
    copies[0].add_(own.mul_(0))
    part = dequantize(QTensor.from_bytes(send.clone(), (n,), torch.float32, 4, BLOCK),
                      out=scratch_buffer("delta_part", n, master.device))
    copies[1].add_(part.mul_(0))


if __name__ == "__main__":
    torch.set_num_threads(1)
    release_freed_host_memory()
    x = torch.randn(1_769_472)
    rows = x[: 2 * (x.numel() // 8)].view(2, -1)
    codec = HopCodec(4, BLOCK, error_feedback=True)
    print(f"error-feedback encode: {median_ms(lambda: _encode(rows, codec, 0)):.2f} ms")
    for bits in (8, 4):
        print(f"INT{bits} quantize: {median_ms(lambda b=bits: quantize(x, b, BLOCK)):.2f} ms")

    share = x.numel() // 4
    row, residual = torch.randn(share), torch.zeros(share)
    send = torch.empty(QTensor.wire_bytes(share, 4, BLOCK), dtype=torch.uint8)
    copies = torch.randn(2, share)
    master = copies[0] + 1e-3 * torch.randn(share)
    runs = {"error feedback": lambda f: error_feedback(row, residual, send, f),
            "qWD owner (encode + apply)": lambda f: delta(master, copies, f)}
    times = {(name, f): [] for name in runs for f in (False, True)}
    for i in range(300):
        for name, fn in runs.items():
            for fused in ((False, True) if i % 2 else (True, False)):
                t = time.perf_counter()
                fn(fused)
                times[name, fused].append(time.perf_counter() - t)
    for name in runs:
        old, new = (statistics.median(times[name, f]) * 1e3 for f in (False, True))
        print(f"{name}, {share} values: unpacking its own bytes {old:.3f} ms, "
              f"dequantized= {new:.3f} ms ({new / old:.2f}x)")
