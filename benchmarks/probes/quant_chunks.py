"""INT8 / INT4 quantize (and + dequantize) throughput on a CUDA device by
quant.DEVICE_CHUNK_BYTES, against a device copy of the same bytes; best of 7.
Run on a GPU: python benchmarks/probes/quant_chunks.py (the H200's output in
benchmarks/gpu/2026-12-04_h200_quant_chunks.md,
from the same loops written inline)."""
import time

import torch

from zeropp import quant
from zeropp.quant import dequantize, quantize


def best(f, r: int = 7) -> float:
    f()
    ts = []
    for _ in range(r):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def sizes(mib: int) -> None:
    x = torch.randn(mib * 2**20 // 4, device="cuda")
    out, dst = torch.empty_like(x), torch.empty_like(x)
    c = best(lambda: dst.copy_(x))
    for ch in (4, 32, 128, 1024):
        quant.DEVICE_CHUNK_BYTES = ch << 20
        for bits in (8, 4):
            q = best(lambda: quantize(x, bits, 2048))  # noqa: B023 - called at once
            qd = best(lambda: out.copy_(dequantize(quantize(x, bits, 2048))))  # noqa: B023
            print(f"{mib} MiB chunk {ch} MiB int{bits}: quantize {x.nbytes / q / 1e9:.0f} GB/s, "
                  f"+dequantize {x.nbytes / qd / 1e9:.0f} GB/s (copy {x.nbytes / c / 1e9:.0f})",
                  flush=True)


if __name__ == "__main__":
    for mib in (64, 256):
        sizes(mib)
