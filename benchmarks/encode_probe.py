"""Single-process timings of the quantization paths on one unit-sized tensor
(1.8M values: one gpt-6x384 block), with the glibc setting the engine makes
(mmap threshold pinned at 1 MiB, zeropp.memory): error feedback's encode of
an inter-node hop (2 rows, one sent) and INT8 / INT4 quantize. Median of 40.

    python benchmarks/encode_probe.py
"""
import time

import torch

from zeropp.memory import release_freed_host_memory
from zeropp.qgz import HopCodec, _encode
from zeropp.quant import quantize


def median_ms(fn, n: int = 40) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3


if __name__ == "__main__":
    torch.set_num_threads(1)
    release_freed_host_memory()
    x = torch.randn(1_769_472)
    rows = x[: 2 * (x.numel() // 8)].view(2, -1)
    codec = HopCodec(4, 2048, error_feedback=True)
    print(f"error-feedback encode: {median_ms(lambda: _encode(rows, codec, 0)):.2f} ms")
    for bits in (8, 4):
        print(f"INT{bits} quantize: {median_ms(lambda b=bits: quantize(x, b, 2048)):.2f} ms")
