"""Wall time to a validation loss for replica groups across a slow link with delay.

Two parts, as the loss does not depend on the link:
- the steps each method needs to reach stock HSDP's validation loss at step 512 come
  from its loss curves, the runs of `replicas_frontier.py` (loopback, per seed);
- the seconds per step come from this script, which runs every method in one
  invocation on the emulated cluster (2 nodes of 2 ranks, `--rate` with `--delay`
  one-way), timed over whole sync rounds after a first one that warms up.
It also checks the accounting against the wire over the timed steps: the bytes the
relay carried from node to node (its flows, IP headers included; the lighthouse's
membership traffic counted apart) against what zeropp's accounting says the groups sent.

    python benchmarks/replicas_frontier.py run --out runs/frontier     # the curves
    python benchmarks/replicas_time.py --curves runs/frontier --timings runs/time.json --write
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from _report import report

from zeropp.bench.cluster import Cluster
from zeropp.config import named
from zeropp.train.loop import TrainArgs, prepare_tokens
from zeropp.train.replicas import ReplicaArgs, run_replicas

# (name, H, codec); H=1 is HSDP every step, H>1 DiLoCo
METHODS = [("stock HSDP", 1, "fp32"), ("HSDP, zeropp 2bit", 1, "2bit"),
           ("torchft DiLoCo (fp32)", 32, "fp32"), ("zeropp DiLoCo, 2bit", 32, "2bit"),
           ("zeropp DiLoCo, int4", 32, "int4")]
TARGET_STEP = 512


def timed(H: int, codec: str, a: argparse.Namespace, tokens: Path, vocab: int,
          shaped: bool = True) -> dict:
    """One method on the cluster: seconds per step over whole rounds after the first;
    shaped, also the wire bytes against the accounting over those steps. Unshaped
    (veth links, no delay): the method's compute time per step here."""
    rounds = a.rounds if H > 1 else 1
    warm = H if H > 1 else a.hsdp_warm
    steps = warm + (H * rounds if H > 1 else a.hsdp_steps)
    t = TrainArgs(model=a.model, steps=steps, eval_every=10**9, log_every=10**9, seed=0)
    ra = ReplicaArgs(replicas=2, group_size=2, sync_every=H, outer_codec=codec)
    with tempfile.TemporaryDirectory() as d:
        cluster = Cluster(2, a.rate if shaped else None, prefix="zpptime",
                          delay=a.delay if shaped else 0)
        snaps: dict = {}
        with cluster:
            watch = threading.Thread(target=_snapshots, daemon=True,
                                     args=(cluster, Path(d) / "replica0" / "metrics.jsonl",
                                           (warm - 1, steps - 1), snaps))
            if shaped:
                watch.start()
            groups = run_replicas(t, named("zeropp-plus", 2), ra, Path(d), tokens, vocab,
                                  timeout=3600, cluster=cluster)
            if shaped:
                watch.join(10)
        lh_port = int((Path(d) / "lighthouse.txt").read_text().strip().rsplit(":", 1)[1])
    wall = {r["step"]: r["wall"] for r in groups[0]}
    n = steps - warm
    out = {"H": H, "codec": codec, "s_per_step": (wall[steps - 1] - wall[warm - 1]) / n}
    if not shaped:
        return out
    for g in (0, 1):  # bytes from node g to the other, in the timed window, per step
        flows = {f[:4]: list(f[4:]) for f in snaps[steps - 1] if f[0] == g}
        for f in snaps[warm - 1]:
            if f[:4] in flows:
                flows[f[:4]] = [flows[f[:4]][0] - f[4], flows[f[:4]][1] - f[5]]
        train = [v for k, v in flows.items() if lh_port not in k[2:]]
        out[f"wire{g}"] = sum(v[0] for v in train) / n
        out[f"payload{g}"] = sum(v[1] for v in train) / n
        out[f"lighthouse{g}"] = sum(v[0] for k, v in flows.items() if lh_port in k[2:]) / n
        out[f"acct{g}"] = sum(r["cross_node_bytes"] for r in groups[g] if r["step"] >= warm) / n
    return out


def _snapshots(cluster: Cluster, metrics: Path, at: tuple, snaps: dict) -> None:
    """The relay's flows as soon as group 0 has logged each step in `at`."""
    while len(snaps) < len(at):
        try:
            done = {json.loads(x)["step"] for x in metrics.read_text().splitlines()}
        except (OSError, ValueError):
            done = set()
        for step in at:
            if step in done and step not in snaps:
                snaps[step] = cluster.flow_bytes()
        time.sleep(0.01)


def steps_to_target(curves: Path, H: int, codec: str) -> list[int | None]:
    """Per seed: the first evaluated step count at which the method's val loss is at
    most stock HSDP's at TARGET_STEP (same seed); None if never in its run."""
    out = []
    for d in sorted((curves / f"H{H}-{codec}").glob("seed*")):
        base = curves / "H1-fp32" / d.name
        if not (d / "summary.md").exists() or not (base / "summary.md").exists():
            continue
        val = lambda p: [(json.loads(x)["step"] + 1, json.loads(x)["val_loss"])  # noqa: E731
                         for x in (p / "replica0" / "metrics.jsonl").read_text().splitlines()
                         if "val_loss" in json.loads(x)]
        target = dict(val(base))[TARGET_STEP]
        out.append(next((n for n, v in val(d) if v <= target), None))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--curves", type=Path, default=Path("runs/frontier"))
    p.add_argument("--rate", default="10mbit")
    p.add_argument("--delay", default="50ms")
    p.add_argument("--model", default="small")
    p.add_argument("--rounds", type=int, default=2, help="timed DiLoCo rounds after the first")
    p.add_argument("--hsdp-steps", type=int, default=12, help="timed HSDP steps")
    p.add_argument("--hsdp-warm", type=int, default=4)
    p.add_argument("--only", default="", help="comma-separated method numbers (0-4)")
    p.add_argument("--compute-baseline", action="store_true",
                   help="also time each method on unshaped links right after (its compute "
                        "here), and report the link's share of each step")
    p.add_argument("--timings", type=Path, default=None,
                   help="a JSON file: written with the timings, or read instead of timing if "
                        "it exists (to report again as more curves finish)")
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    methods = [METHODS[int(i)] for i in a.only.split(",")] if a.only else METHODS
    if a.timings is not None and a.timings.exists():  # measured before: the report only
        rows = [tuple(r) for r in json.loads(a.timings.read_text())]
    else:
        t = TrainArgs(model=a.model)
        ids, vocab = prepare_tokens(t, Path.home() / ".cache" / "zeropp")
        with tempfile.TemporaryDirectory() as d:
            tokens = Path(d) / "tokens.pt"
            torch.save(ids.to(torch.int32), tokens)
            rows = []
            for name, H, codec in methods:
                print(f"timing {name} on {a.rate} + {a.delay}", file=sys.stderr, flush=True)
                r = timed(H, codec, a, tokens, vocab)
                if a.compute_baseline:  # right after, on unshaped links
                    r["compute_s_per_step"] = timed(H, codec, a, tokens, vocab,
                                                    shaped=False)["s_per_step"]
                rows.append((name, r))
        if a.timings is not None:
            a.timings.write_text(json.dumps(rows, indent=1))
    need = {name: steps_to_target(a.curves, H, codec) for name, H, codec in methods}
    mean_need = {k: statistics.mean(v) if v and None not in v else None for k, v in need.items()}
    secs = {name: r["s_per_step"] * mean_need[name] if mean_need[name] else None
            for name, r in rows}
    base, ft = secs.get("stock HSDP"), secs.get("torchft DiLoCo (fp32)")
    link = {name: max(r["s_per_step"] - r["compute_s_per_step"], 0.0) * mean_need[name]
            if "compute_s_per_step" in r and mean_need[name] else None for name, r in rows}
    lbase, lft = link.get("stock HSDP"), link.get("torchft DiLoCo (fp32)")
    lines = [f"### Time to stock HSDP's validation loss at step {TARGET_STEP}, {a.rate} with "
             f"{a.delay} one-way between 2 nodes", "",
             f"Command: `python benchmarks/replicas_time.py --curves {a.curves} --rate {a.rate} "
             f"--delay {a.delay}` (model {a.model}, 2 replica groups x 2 ranks, zeropp-plus "
             "inside each; steps needed from the frontier runs' curves, per seed, mean; seconds "
             f"per step over {a.rounds} DiLoCo rounds after a first, or {a.hsdp_steps} HSDP "
             f"steps after {a.hsdp_warm}, every method timed in this one invocation; "
             "compute: the same steps on unshaped links right after, the link's seconds the "
             "difference). "
             "Accounting: what zeropp counted replica group 0 sending per timed step; wire: "
             "what the link relay carried from node 0 to node 1 in the same steps, as TCP "
             "payload and as IP packets (headers and acks included), the lighthouse's "
             "membership traffic (node 1's) apart.", "",
             "| method | s/step on the link | compute s/step (unshaped) | steps to target (per "
             "seed) | time to target | vs stock HSDP | vs torchft DiLoCo | link's seconds to "
             "target (step - compute) | vs stock HSDP | vs torchft DiLoCo | accounting B/step "
             "| wire payload B/step | payload / accounting | wire IP B/step | lighthouse IP "
             "B/step |", "|" + "---|" * 15]
    for name, r in rows:
        s = secs[name]
        ls = link[name]
        cells = [name, f"{r['s_per_step']:.3f}", f"{r.get('compute_s_per_step', 0):.3f}",
                 str(need[name] or "no curve"),
                 f"{s:,.0f} s" if s else "", f"{base / s:.1f}x" if s and base else "",
                 f"{ft / s:.1f}x" if s and ft else "",
                 f"{ls:,.1f} s" if ls is not None else "",
                 f"{lbase / ls:.0f}x" if ls and lbase else "",
                 f"{lft / ls:.1f}x" if ls and lft else "", f"{r['acct0']:,.0f}",
                 f"{r['payload0']:,.0f}",
                 f"{r['payload0'] / r['acct0']:.3f}" if r["acct0"] else "",
                 f"{r['wire0']:,.0f}", f"{r['lighthouse1']:,.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    report(lines, a.write)


if __name__ == "__main__":
    main()
