"""Shared by the probe benchmarks: run a script's rank worker as 2 nodes x 2 ranks
on the emulated cluster (one torchrun per node namespace) and
return the JSON rank 0 wrote."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path


def run_2x2(script: str, rate: str, prefix: str, port: int, args: list[str],
            quiet: bool = False) -> object:
    """`script --rank-worker OUT *args` on every rank; the JSON at OUT afterwards."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from zeropp.bench.cluster import Cluster
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    with tempfile.TemporaryDirectory() as tmp, Cluster(2, rate, prefix=prefix) as c:
        out = os.path.join(tmp, "rows.json")
        procs = [c.popen(i, [torchrun, "--nnodes", "2", "--node-rank", str(i),
                             "--nproc-per-node", "2", "--master-addr", c.addr(0),
                             "--master-port", str(port), script, "--rank-worker", out, *args],
                         stderr=open(os.devnull, "w") if quiet else None)
                 for i in range(2)]
        for p in procs:
            p.wait(timeout=900)
        return json.loads(Path(out).read_text())


def timed(fn) -> float:
    """Seconds `fn()` takes on this rank, between two barriers (every rank starts
    together and the slowest one ends the interval)."""
    import time

    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0
