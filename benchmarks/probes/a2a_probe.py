"""Does merging the inter-node all-to-alls of several units pay? On the emulated
2 x 2 cluster (one torchrun per node namespace), rank 0's
timings of an all-to-all in the inter-node groups ({0, 2}, {1, 3}) carrying one
unit's qgZ payload of gpt-6x384 (220 kB per rank), four of them back to back (the
drain at the end of backward: the last units' stage 2), and one of four times
the size (the four merged). Five repetitions after two warm-ups.

    python benchmarks/probes/a2a_probe.py 100mbit
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _emulated import run_2x2, timed

PER_RANK = 220_000  # bytes each rank's buffer holds per unit (half goes to the peer)


def _rank_worker(out: str) -> None:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]

    def a2a(units: int) -> None:
        send = torch.zeros(units * PER_RANK, dtype=torch.uint8)
        dist.all_to_all_single(torch.empty_like(send), send, group=group)

    for _ in range(2):
        timed(lambda: a2a(1))
    rows = [(timed(lambda: a2a(1)), timed(lambda: [a2a(1) for _ in range(4)]),
             timed(lambda: a2a(4))) for _ in range(5)]
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-worker":
        _rank_worker(sys.argv[2])
        return
    rate = sys.argv[1] if len(sys.argv) > 1 else "100mbit"
    rows = run_2x2(__file__, rate, "zppq", 29971, [], quiet=True)
    print(f"all-to-all in the inter-node group at {rate}, rank 0, seconds")
    print("| one unit | four units, one after another | the four merged into one |")
    print("|---|---|---|")
    for one, four, merged in rows:
        print(f"| {one:.3f} | {four:.3f} | {merged:.3f} |")


if __name__ == "__main__":
    main()
