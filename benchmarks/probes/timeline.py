"""Where a step's time goes: a per-unit timeline of one zeropp step on the
emulated cluster (rank 0), for finding what is not overlapped.

Runs `zeropp bench`'s worker for one configuration (2 nodes x 2, gpt-6x384 by
default) with timestamps patched around the places that wait: each unit's
gather wait (forward and backward), each gradient hand-over to the reduce
pipeline (and how long the hook blocked on a full pipeline), each reduction's
two stages on their threads, qWD's delta encode and issue (zeropp-plus), the end of
backward's compute and the drain. Prints the last timed step of rank 0, or of every
rank (`--all-ranks`: one clock, the machine's monotonic one, so a rank waiting on
another shows as the other's lateness), times relative to rank 0's first event.

    python benchmarks/probes/timeline.py --config zeropp --inter-node 100mbit [--all-ranks]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _traced_worker(events_path: str, argv: list[str]) -> None:
    import zeropp.grads.pipeline as reduce_mod
    shard_mod = sys.modules["zeropp.shard"]  # zeropp.shard is also the function's name
    events: list = []
    now = time.perf_counter

    def wrap(cls, name, record):
        real = getattr(cls, name)

        def traced(self, *a):
            t = now()
            out = real(self, *a)
            events.append(record(self, a, t, now(), out))
            return out
        setattr(cls, name, traced)

    wrap(reduce_mod.ReducePipeline, "submit", lambda s, a, t, e, out: ("hand-over", a[0], t, e))
    wrap(reduce_mod.ReducePipeline, "_run_first",
         lambda s, a, t, e, out: ("reduce 1", a[0].label, t, e))
    wrap(reduce_mod.ReducePipeline, "_run_second",
         lambda s, a, t, e, out: ("reduce 2", a[0].label, t, e))
    wrap(shard_mod.Unit, "wait", lambda s, a, t, e, out: ("gather wait", s.label, t, e))
    wrap(shard_mod.ShardState, "end_backward", lambda s, a, t, e, out: ("drain", "", t, e))
    import zeropp.weights as weights_mod
    wrap(weights_mod.WeightPath, "issue",
         lambda s, a, t, e, out: (f"gather issue ({out.route.value})", a[0].unit, t, e))
    from zeropp.bench import worker
    sys.argv = ["worker", *argv]
    worker.main()
    Path(f"{events_path}.{os.environ.get('RANK', '0')}").write_text(json.dumps(events))


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--traced-worker":
        _traced_worker(sys.argv[2], sys.argv[3:])
        return
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="zeropp")
    p.add_argument("--inter-node", default="100mbit")
    p.add_argument("--model", default="gpt-6x384")
    p.add_argument("--all-ranks", action="store_true", help="every rank's events, not rank 0's")
    a = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from zeropp.bench.cluster import Cluster
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    with tempfile.TemporaryDirectory() as tmp, Cluster(2, a.inter_node, prefix="zppt") as c:
        ev_path = os.path.join(tmp, "events.json")
        worker_args = ["--config", a.config, "--model", a.model, "--steps", "2",
                       "--out", os.path.join(tmp, "result.json")]
        procs = [c.popen(i, [torchrun, "--nnodes", "2", "--node-rank", str(i),
                             "--nproc-per-node", "2", "--master-addr", c.addr(0),
                             "--master-port", "29960", __file__, "--traced-worker", ev_path,
                             *worker_args], stdout=open(os.devnull, "w"),
                             stderr=open(os.path.join(tmp, f"log{i}"), "w"))
                 for i in range(2)]
        for proc in procs:
            proc.wait(timeout=900)
        ranks = range(4) if a.all_ranks else range(1)
        if not all(os.path.exists(f"{ev_path}.{r}") for r in ranks):
            sys.exit("timeline: the run failed:\n" + Path(tmp, "log0").read_text()[-3000:])
        events = [json.loads(Path(f"{ev_path}.{r}").read_text()) for r in ranks]
    t0 = None
    print(f"{a.config} at {a.inter_node}, {'every rank' if a.all_ranks else 'rank 0'}, last "
          "step (seconds from rank 0's first event)")
    for r, evs in zip(ranks, events):
        drains = [i for i, e in enumerate(evs) if e[0] == "drain"]
        step = evs[drains[-2] + 1:drains[-1] + 1]  # the last step: after the previous drain
        t0 = min(e[2] for e in step) if t0 is None else t0
        for kind, label, t, end in sorted(step, key=lambda e: e[2]):
            who = f"r{r} " if a.all_ranks else ""
            print(f"{who}{kind:12s} {label:8s} {t - t0:7.3f} -> {end - t0:7.3f}  ({end - t:.3f})")


if __name__ == "__main__":
    main()
