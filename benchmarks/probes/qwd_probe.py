"""qWD's per-step work on one rank at 2 x 2 of one gpt-6x384 block (1.77M values:
a 442K-value shard owned, two 442K-value copies held), single process, with the
glibc setting the engine makes: the way each of its copy forms refreshes them.

  exact+int8  fp32 copies (up to the eleventh session's default; since retired
              from the library, built here from quantize alone): the owner
              quantizes master - copy to INT4 and adds it to its copy, the holder
              adds the other owner's decoded delta, then the holder quantizes both
              copies to INT8 for the node's gathers.
  codes       INT8 copies (qwd.py): the owner quantizes its master as qwZ does and
              sends how the codes moved; the holder moves the other copy's codes.

The two alternate, 300 times each, so the machine's drift touches both alike;
medians and the ratio.

    python benchmarks/probes/qwd_probe.py
"""
import statistics
import time

import torch

from zeropp import qwd
from zeropp.host_memory import release_freed_host_memory
from zeropp.quant import QTensor, dequantize, quantize, scratch_buffer

BLOCK, SHARD = 2048, 442368


def exact_then_int8(master, copies, payload, other_delta):
    own = scratch_buffer("own", SHARD, master.device)
    diff = torch.sub(master, copies[0], out=scratch_buffer("diff", SHARD, master.device))
    send = quantize(diff, 4, BLOCK, dequantized=own).to_bytes()
    copies[0].add_(own)
    q = QTensor.from_bytes(other_delta, (SHARD,), torch.float32, 4, BLOCK)
    copies[1].add_(dequantize(q, out=scratch_buffer("part", SHARD, master.device)))
    wb = QTensor.wire_bytes(SHARD, 8, BLOCK)
    for k in range(2):
        quantize(copies[k], 8, BLOCK, out=payload[k * wb:(k + 1) * wb])
    return send


def codes(master, copies, other_delta):
    db = qwd.wire_bytes(SHARD, BLOCK)
    send = torch.empty(db, dtype=torch.uint8)
    qwd.encode(master, copies[0], send, block=BLOCK)
    qwd.apply(copies[1], other_delta, numel=SHARD, block=BLOCK)
    return send


def main() -> None:
    release_freed_host_memory()
    torch.manual_seed(0)
    w0 = torch.randn(2, SHARD) * 0.02
    moves = [torch.randn(2, SHARD) * 2e-4 for _ in range(8)]  # AdamW-sized steps
    # exact copies + their INT8 payload
    copies_f = w0.clone()
    payload = torch.empty(2 * QTensor.wire_bytes(SHARD, 8, BLOCK), dtype=torch.uint8)
    delta_f = quantize(moves[0][1], 4, BLOCK).to_bytes().clone()
    # INT8 copies as codes
    wb = QTensor.wire_bytes(SHARD, 8, BLOCK)
    copies_c = torch.cat([quantize(w0[k], 8, BLOCK).to_bytes() for k in range(2)]).view(2, wb)
    delta_c = torch.empty(qwd.wire_bytes(SHARD, BLOCK), dtype=torch.uint8)
    other = quantize(w0[1], 8, BLOCK).to_bytes().clone()
    qwd.encode(w0[1] + moves[0][1], other, delta_c, block=BLOCK)
    times = {"exact+int8": [], "codes": []}
    master = w0[0].clone()
    for i in range(300):
        master += moves[i % 8][0]
        for name in (("exact+int8", "codes") if i % 2 else ("codes", "exact+int8")):
            t = time.perf_counter()
            if name == "codes":
                codes(master, copies_c, delta_c)
            else:
                exact_then_int8(master, copies_f, payload, delta_f)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:11s} {v:.3f} ms per block per rank per step")
    print(f"codes / exact+int8: {med['codes'] / med['exact+int8']:.3f}")


if __name__ == "__main__":
    main()
