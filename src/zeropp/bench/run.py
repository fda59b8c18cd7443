"""`zeropp bench`: configurations side by side on the emulated cluster.

Each configuration runs as one process per rank, inside its node's namespace,
with the environment torchrun would give it, on the same model, data and units;
the busiest node's interface counters give the wire bytes, zeropp's accounting
its own figure. Without root or `ip netns` it says so in one line and runs on
plain loopback instead (no link limit, no counters).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..cli.launch import host_store
from ..config import is_named
from .cluster import Cluster, available, parse_rate, rate_bytes_per_s

FSDP = ["fsdp2", "fsdp2-hsdp", "fsdp2-tp"]
DEEPSPEED = ["deepspeed-zero3", "deepspeed-hpz"]
ALL = [*FSDP, "fsdp2+zeropp", "fsdp2+zeropp-plus", *DEEPSPEED, "zero3", "qwz", "hpz", "qgz",
       "zeropp", "zeropp-plus"]


def known(cfg: str) -> bool:
    """FSDP2's three layouts (1-D, HSDP, TP x FSDP), DeepSpeed's two, a zeropp preset
    with any ~SWITCH flips (e.g. zeropp~async), or an FSDP2 layout +PRESET (stock FSDP2
    with zeropp.fsdp2.install: fsdp2+zeropp, fsdp2-tp+zeropp-plus, ...)."""
    base, preset = cfg.partition("+")[::2]
    return (cfg in FSDP or cfg in DEEPSPEED or is_named(cfg)
            or (base in FSDP and is_named(preset)))


def _without_missing_deepspeed(configs: list[str]) -> list[str]:
    """DeepSpeed rows need the optional extra; without it they are left out, said in
    one line."""
    if not any(c in DEEPSPEED for c in configs) or importlib.util.find_spec("deepspeed"):
        return configs
    left = [c for c in configs if c not in DEEPSPEED]
    print(f"zeropp bench: {', '.join(c for c in configs if c in DEEPSPEED)} skipped: DeepSpeed "
          "is not installed (DS_BUILD_OPS=0 pip install 'zeropp[bench]')", flush=True)
    return left


def _worker_cmd(cfg: str, ns, out: Path) -> list[str]:
    return ["-m", "zeropp.bench.worker", "--config", cfg, "--model", ns.model, "--seq-len",
            str(ns.seq_len), "--batch", str(ns.batch), "--steps", str(ns.steps), "--dtype",
            ns.dtype, "--node-size", str(ns.node_size), "--out", str(out)]


def rank_env(rank: int, nodes: int, node_size: int, master: str, port: int) -> dict:
    """The environment torchrun gives rank `rank` of `nodes` x `node_size` ranks."""
    world = nodes * node_size
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % node_size),
            "LOCAL_WORLD_SIZE": str(node_size), "GROUP_RANK": str(rank // node_size),
            "MASTER_ADDR": master, "MASTER_PORT": str(port),
            # torchrun's default with several ranks per machine; the user's value wins
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def _run_one(cluster, k: int, cfg: str, ns, out: Path) -> dict:
    out.unlink(missing_ok=True)  # a stale result must not pass for this run's
    # Every rank is started directly with the environment torchrun would give it: a
    # torchrun agent per node would import torch once more per node and run, and
    # could then sit minutes in its exit barrier.
    cmd = [sys.executable, *_worker_cmd(cfg, ns, out)]
    kw = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs: list[subprocess.Popen] = []
    logs: list[list[str]] = []
    readers: list[threading.Thread] = []
    deadline, done_at = time.monotonic() + ns.timeout, None
    try:
        world = ns.nodes * ns.node_size
        if cluster is None:  # plain loopback: one "node" holds every rank, and this
            # process hosts the store, as `zeropp launch` does (no race for a free port)
            store = host_store(ns.timeout)
            nodes, size, master, port = 1, world, "127.0.0.1", store.port
        else:  # a fresh port per configuration inside the namespaces: no TIME_WAIT clash
            nodes, size, master, port = ns.nodes, ns.node_size, cluster.addr(0), 29600 + k
        for r in range(world):
            e = rank_env(r, nodes, size, master, port)
            p = (subprocess.Popen(cmd, env={**os.environ, **e,
                                            "TORCHELASTIC_USE_AGENT_STORE": "True"}, **kw)
                 if cluster is None else cluster.popen(r // size, cmd, env=e, **kw))
            procs.append(p)
            logs.append([])
            readers.append(threading.Thread(target=lambda p=p, buf=logs[-1]: buf.extend(p.stdout),
                                            daemon=True))
            readers[-1].start()
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"configuration {cfg} did not finish in {ns.timeout:.0f}s")
            if out.exists():
                # The result is written: give the ranks 20 s to leave, then stop them.
                done_at = done_at or time.monotonic()
                if time.monotonic() - done_at > 20:
                    break
            elif any(p.poll() not in (None, 0) for p in procs):
                break  # a rank failed before the result: the others would wait for it
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for t in readers:
            t.join(timeout=5)
    # Rank 0 writes the result only after every rank finished the measurement;
    # a rank stopped after that changes nothing.
    if not out.exists():
        logs = ["".join(buf) for buf in logs]
        tail = "\n".join(logs)[-2500:]
        raise RuntimeError(f"configuration {cfg} failed:\n{tail}")
    return json.loads(out.read_text())


def run_bench(ns) -> tuple[list[dict], Path]:
    rate = parse_rate(ns.inter_node)
    configs = [c.strip() for c in ns.configs.split(",") if c.strip()]
    bad = [c for c in configs if not known(c)]
    if bad or not configs:
        raise ValueError(f"unknown configuration {bad[0] if bad else ''!r}; choose from "
                         f"{', '.join(ALL)} (zeropp presets also with ~SWITCH flips)")
    configs = _without_missing_deepspeed(configs)
    if not configs:
        raise ValueError("no configuration left to run")
    if ns.nodes < 1 or ns.node_size < 1:
        raise ValueError(f"--nodes {ns.nodes} and --node-size {ns.node_size} must be >= 1")
    if ns.nproc is not None and ns.nproc != ns.nodes * ns.node_size:
        raise ValueError(f"--node-size {ns.node_size} does not divide --nproc {ns.nproc} into "
                         f"{ns.nodes} nodes")
    for flag in ("rounds", "steps", "batch", "seq_len"):  # (0 steps: a traceback per
        if getattr(ns, flag) < 1:  # rank; an empty batch: step times of nothing, loss nan)
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(ns, flag)} must be >= 1")
    Cluster(ns.nodes, rate)  # validates the node count against the subnet
    out_dir = Path(ns.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    try:  # (not cli.commands.make_dir: that module imports this one)
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out_dir}: cannot create this directory ({e.strerror})"
                         ) from None
    ok, why = available()
    if not ok:
        print(f"zeropp bench: no emulated cluster ({why}); running on plain loopback instead",
              flush=True)
    baseline = getattr(ns, "compute_baseline", False) and ok
    shaped, unshaped = _run_all(ns, configs, rate if ok else False, out_dir, baseline)
    results = [merge_rounds(runs) for runs in shaped]
    base = [merge_rounds(runs) for runs in unshaped]
    for r in results:
        r["link"] = rate if ok else "loopback"
    if baseline:
        for r, b in zip(results, base):
            r["compute_s"] = b["median_step_s"]
            r["compute_host_cpu_s_per_step"] = b.get("host_cpu_s_per_step")
            rx = r["wire_rx_tx_bytes_per_node_step"] - r["wire_tx_bytes_per_node_step"]
            r["link_s"] = max(rx, r["wire_tx_bytes_per_node_step"]) / rate_bytes_per_s(rate)
            # the busiest node's forward bytes over its bytes (both its, so a share <= 1)
            fwd, acct = (r.get("accounted_forward_inter_bytes_per_node_step"),
                         r["accounted_inter_bytes_per_node_step"])
            if b.get("phases_s") and fwd is not None and acct:
                r["compute_phases_s"] = [statistics.median(p[i] for p in b["phases_s"])
                                         for i in range(3)]
                r["phase_bound_s"] = phase_bound(r["compute_phases_s"], r["link_s"], fwd / acct)
    (out_dir / "bench.json").write_text(json.dumps(results, indent=2))
    return results, out_dir


def phase_bound(phases: list[float], link_s: float, forward_share: float) -> float:
    """The shortest step this configuration's schedule allows, whatever the machine:
    the forward's link traffic (its weight gathers) can only overlap the forward's
    compute, and the backward's (gradients, and weights gathered again) only the
    backward's, because the optimizer step between them needs every gradient and
    makes the weights the next forward gathers. So a step takes at least
    max(forward compute, forward link) + max(backward compute, backward link) +
    the optimizer step: `phases` are the unshaped run's forward / backward /
    optimizer seconds, the link time splits by the accounting's forward share.
    Where one phase is link-bound and the other compute-bound, this is above
    max(compute, link), and no overlap can reach the latter."""
    fwd_c, bwd_c, opt_c = phases
    return (max(fwd_c, link_s * forward_share) + max(bwd_c, link_s * (1 - forward_share))
            + opt_c)


def _run_all(ns, configs: list[str], rate, out_dir: Path,
             baseline: bool) -> tuple[list[list[dict]], list[list[dict]]]:
    """Every configuration `ns.rounds` times, in turn (A B A B ...), on the emulated
    cluster at `rate` or on plain loopback (`rate` False); with `baseline`, each run
    also right after on unshaped links (its compute time, plus what its bytes cost at
    veth speed), on a second cluster built beside the first: each pair runs minutes
    apart at most, so the machine's drift (its speed moves by 20% within an hour
    here) touches the step and its baseline alike. Returns the runs by configuration,
    one per round: (results, baselines; empty without `baseline`)."""
    shaped: list[list[dict]] = [[] for _ in configs]
    unshaped: list[list[dict]] = [[] for _ in configs] if baseline else []
    with contextlib.ExitStack() as stack:
        c = None if rate is False else stack.enter_context(Cluster(ns.nodes, rate, "zppb"))
        u = stack.enter_context(Cluster(ns.nodes, None, "zppu")) if baseline else None
        for r in range(ns.rounds):
            tag = f"-r{r + 1}" if ns.rounds > 1 else ""
            for k, cfg in enumerate(configs):
                port = r * len(configs) + k  # a fresh port per world (see _run_one)
                where, name = (k, cfg, configs, r, ns.rounds), f"{cfg}{tag}"
                shaped[k].append(_progress(*where, lambda p=port, cfg=cfg, n=name: _run_one(
                    c, p, cfg, ns, out_dir / f"{n}.json")))
                if u is not None:
                    unshaped[k].append(_progress(*where, lambda p=port, cfg=cfg, n=name: _run_one(
                        u, p, cfg, ns, out_dir / f"{n}-compute.json"), "unshaped"))
    return shaped, unshaped


def merge_rounds(runs: list[dict]) -> dict:
    """One configuration's result over its rounds: the median of every timed step
    of every round, each round's own median (`round_medians_s`), the byte figures
    as medians (the accounting is the same each round; the counters move by a few
    hundred bytes), the largest peak RSS. The final loss is each round's, bit for
    bit (same model, data and code), so the first stands for all."""
    if len(runs) == 1:
        return {**runs[0], "round_medians_s": [runs[0]["median_step_s"]]}
    out = dict(runs[0])
    out["times"] = [t for r in runs for t in r["times"]]
    out["median_step_s"] = statistics.median(out["times"])
    out["round_medians_s"] = [r["median_step_s"] for r in runs]
    for key in ("wire_rx_tx_bytes_per_node_step", "wire_tx_bytes_per_node_step",
                "accounted_inter_bytes_per_node_step", "accounted_intra_bytes_per_node_step",
                "accounted_forward_inter_bytes_per_node_step"):
        if runs[0].get(key) is not None:
            out[key] = statistics.median(r[key] for r in runs)
    out["phases_s"] = [p for r in runs for p in r["phases_s"]]
    out["host_cpu_s_per_step"] = None  # unless every round has it
    if all(r.get("host_cpu_s_per_step") for r in runs):
        out["host_cpu_s_per_step"] = [statistics.median(r["host_cpu_s_per_step"][i] for r in runs)
                                      for i in range(4)]
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
    return out


def rounds_line(results: list[dict]) -> str:
    """With several rounds: how often the fastest configuration (by the median
    over all rounds) was also the fastest round by round, and its median paired
    ratio to the runner-up, round by round (the runs of one round are minutes
    apart, so the machine's drift between rounds cancels in the ratio)."""
    n = len(results[0]["round_medians_s"])
    if n < 2 or len(results) < 2:
        return ""
    ranked = sorted(results, key=lambda r: r["median_step_s"])
    best, nxt = ranked[0], ranked[1]
    wins = sum(min(results, key=lambda r: r["round_medians_s"][i]) is best for i in range(n))
    ratios = [b / a for a, b in zip(best["round_medians_s"], nxt["round_medians_s"])]
    return (f"Rounds: {best['config']} fastest in {wins} of {n}; {nxt['config']} / "
            f"{best['config']} by round {', '.join(f'{x:.2f}' for x in ratios)} "
            f"(median {statistics.median(ratios):.2f}).")


def _progress(k: int, cfg: str, configs: list[str], round_: int, rounds: int, fn,
              link: str = "") -> dict:
    where = f"round {round_ + 1}/{rounds} " if rounds > 1 else ""
    print(f"[{where}{k + 1}/{len(configs)}] {cfg}{f' ({link})' if link else ''} ...", end=" ",
          flush=True)
    t0 = time.perf_counter()
    r = fn()
    print(f"{r['median_step_s']:.2f} s/step, {r['wire_rx_tx_bytes_per_node_step'] / 1e6:.1f} MB "
          f"on the link per node per step ({time.perf_counter() - t0:.0f}s)", flush=True)
    return r


def table(results: list[dict], base: str = "fsdp2") -> str:
    ref = next((r for r in results if r["config"] == base), results[0])
    lines = [f"| config | median s/step | speedup vs {ref['config']} | link MB/node/step (rx+tx) "
             f"| vs {ref['config']} | accounted MB sent/node/step | tx MB/node/step | "
             "accounting vs tx | accounted intra-node MB/node/step | peak RSS MB/rank | "
             "final loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    def mb(x):
        return "n/a" if x is None else f"{x / 1e6:.1f}"

    def ratio(a, b):  # n/a without a figure, or on loopback (no link, no counters)
        return "n/a" if a is None or not b else f"{a / b:.3f}"
    ref_wire = ref["wire_rx_tx_bytes_per_node_step"]
    for r in results:
        acct, tx = r["accounted_inter_bytes_per_node_step"], r["wire_tx_bytes_per_node_step"]
        wire = r["wire_rx_tx_bytes_per_node_step"]
        lines.append(
            f"| {r['config']} | {r['median_step_s']:.2f} | "
            f"{ref['median_step_s'] / r['median_step_s']:.2f}x | {mb(wire)} | "
            f"{ratio(wire, ref_wire)} | {mb(acct)} | {mb(tx)} | {ratio(acct, tx)} | "
            f"{mb(r['accounted_intra_bytes_per_node_step'])} | {r['peak_rss_mb']:.0f} | "
            f"{r['final_loss']:.4f} |")
    if all("compute_s" in r for r in results):
        lines = _with_overlap(lines, results)
    return "\n".join(lines)


def _with_overlap(lines: list[str], results: list[dict]) -> list[str]:
    """Add compute s (unshaped run), link s (wire bytes at the link rate),
    step / max(compute, link) (1.0 is perfect overlap, the sum of the two is up to
    2.0), and the phase bound (`phase_bound`; zeropp's configurations, which count
    their forward's bytes) with the step over it."""
    out = [lines[0] + " compute s (unshaped) | link s (bytes / rate) | step / max(compute, link) "
                      "| phase bound s | step / phase bound |",
           lines[1] + "---|---|---|---|---|"]
    for line, r in zip(lines[2:], results):
        bound, phased = max(r["compute_s"], r["link_s"]), r.get("phase_bound_s")
        tail = "n/a | n/a" if phased is None else (
            f"{phased:.2f} | {r['median_step_s'] / phased:.2f}")
        out.append(line + f" {r['compute_s']:.2f} | {r['link_s']:.2f} | "
                          f"{r['median_step_s'] / bound:.2f} | {tail} |")
    return out


def chart(results: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [r["config"] for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar(names, [r["median_step_s"] for r in results], color="tab:blue")
    a.set_ylabel("median s/step")
    b.bar(names, [r["wire_rx_tx_bytes_per_node_step"] / 1e6 for r in results],
          color="tab:orange")
    b.set_ylabel("inter-node MB per node per step (rx+tx)")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
