"""The emulated cluster: namespaces as nodes, shaped links, interface counters.
The smoke test runs for real where root and `ip netns` are available and is
skipped with the reason otherwise."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from cases import cli_error_line

from zeropp.bench.cluster import Cluster, available, leftovers, parse_delay, parse_rate
from zeropp.bench.run import phase_bound

OK, WHY = available()


@pytest.mark.parametrize("bad", ["fast", "100", "100 mbps", "-5mbit", ""])
def test_unparsable_rate_is_one_clear_error(bad):
    with pytest.raises(ValueError, match="unparsable link rate"):
        parse_rate(bad)


def test_rates_tc_understands_pass():
    assert parse_rate("100mbit") == "100mbit" and parse_rate("1.5Gbit") == "1.5gbit"


@pytest.mark.parametrize("bad", ["50", "fast", "-5ms", "50 msec", -1, True])
def test_unparsable_delay_is_one_clear_error(bad):
    with pytest.raises(ValueError, match="unparsable link delay"):
        parse_delay(bad)


def test_delays_parse_to_seconds():
    assert parse_delay("50ms") == 0.05 and parse_delay("250us") == 0.00025
    assert parse_delay(0) == 0.0


_ECHO = """import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("10.77.0.2", 5599)); s.listen(); c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 16)
    if not b: break
    n += len(b)
    if len(b) == 1: c.sendall(b)  # a ping: answer it
print(n)"""
_PING = """import socket, time
s = socket.create_connection(("10.77.0.2", 5599), timeout=10)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(5):
    t = time.perf_counter(); s.sendall(b"p"); s.recv(1); rtts.append(time.perf_counter() - t)
s.sendall(bytes(1_000_000)); s.close(); print(sorted(rtts)[2])"""


@pytest.mark.skipif(not OK, reason=f"no emulated cluster here: {WHY}")
def test_a_link_with_delay_holds_each_packet_and_counts_the_payload_it_carries():
    """delay 20ms one way: a TCP ping's median round trip is 40 to 50 ms (it was ~0.05
    ms unshaped); the relay counts exactly the 1,000,005 bytes of TCP payload node 0
    sent node 1 on that connection; nothing is left behind."""
    with Cluster(2, "100mbit", prefix="zppdly", delay="20ms") as c:
        echo = c.popen(1, [sys.executable, "-c", _ECHO], stdout=subprocess.PIPE, text=True)
        ping = None
        for _ in range(50):  # until the echo server listens
            ping = c.popen(0, [sys.executable, "-c", _PING], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
            if ping.wait(60) == 0:
                break
        rtt = float(ping.stdout.read())
        assert echo.communicate(timeout=60)[0].strip() == "1000005"
    assert 0.040 <= rtt < 0.050, rtt
    sent = [f for f in c.flows if f[0] == 0 and f[3] == 5599]
    assert sum(f[5] for f in sent) == 1_000_005, sent
    assert leftovers("zppdly") == []


def test_more_nodes_than_the_subnet_holds_is_rejected():
    with pytest.raises(ValueError, match="1 to 253 nodes"):
        Cluster(300)


@pytest.mark.skipif(not OK, reason=f"no emulated cluster here: {WHY}")
def test_a_stop_during_teardown_is_raised_after_it_and_leaves_no_namespace(monkeypatch):
    """A Ctrl-C (or SIGTERM) while the cluster's namespaces go was raised between two
    `ip netns del`s and left the rest (a review's `zeropp bench`, stopped just after its
    last result line). Now it waits for the teardown's end."""
    import os
    import signal

    from zeropp.bench import cluster
    prefix, listed = "zppstop", cluster.leftovers

    def interrupted(name: str) -> list[str]:  # a Ctrl-C as the teardown starts
        os.kill(os.getpid(), signal.SIGINT)
        return listed(name)
    c = Cluster(2, "1gbit", prefix=prefix).__enter__()
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # (xdist: ignored)
    try:
        monkeypatch.setattr(cluster, "leftovers", interrupted)
        with pytest.raises(KeyboardInterrupt):
            c.teardown()
        assert listed(prefix) == []
    finally:
        signal.signal(signal.SIGINT, handler)
        monkeypatch.setattr(cluster, "leftovers", listed)
        c.teardown()


@pytest.mark.skipif(not OK, reason=f"no emulated cluster here: {WHY}")
def test_two_nodes_train_over_a_shaped_link_and_leave_nothing_behind(tmp_path):
    """2 nodes x 1 rank, 2 steps of the main job under torchrun, one torchrun
    per namespace: bytes cross cl0 (at least what zeropp's accounting says it
    sent) and no namespace or process outlives the run, even one a killed run
    left (simulated by creating a stale namespace first)."""
    prefix = "zpptest"
    subprocess.run(["ip", "netns", "add", f"{prefix}0"], capture_output=True)  # stale
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    with Cluster(2, "1gbit", prefix=prefix) as c:
        procs = [c.popen(i, [torchrun, "--nnodes", "2", "--node-rank", str(i),
                             "--nproc-per-node", "1", "--master-addr", c.addr(0),
                             "--master-port", "29517", "-m", "zeropp.train", "--model", "tiny",
                             "--seq-len", "32", "--steps", "2", "--eval-every", "2",
                             "--out", str(tmp_path / "run")],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(2)]
        outs = [p.communicate(timeout=240)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
        rx, tx = c.counters(0)
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    accounted = sum(m["inter_node_bytes"] for m in metrics)
    assert accounted > 0
    assert tx >= accounted, (tx, accounted)  # the wire carries payload plus TCP/IP overhead
    print(f"node 0 sent {tx} bytes on cl0; zeropp accounted {accounted:.0f}")
    assert leftovers(prefix) == []


def _bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zeropp", "bench", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args,message", [
    (["--inter-node", "fast"], "unparsable link rate 'fast'"),
    (["--nodes", "300"], "1 to 253 nodes"),
    (["--nodes", "2", "--node-size", "3", "--nproc", "4"], "--node-size 3 does not divide"),
    (["--configs", "zero3,deepspeed"], "unknown configuration 'deepspeed'"),
    (["--configs", "fsdp2-tp+zeropp,fsdp2-tp+zero4"], "unknown configuration 'fsdp2-tp+zero4'"),
    (["--rounds", "0"], "--rounds 0 must be >= 1"),
    (["--steps", "0"], "--steps 0 must be >= 1"),  # (was a traceback per rank)
    (["--batch", "0"], "--batch 0 must be >= 1"),  # (timed empty steps, loss nan)
    (["--seq-len", "0"], "--seq-len 0 must be >= 1"),
    (["--out", "/dev/null"], "--out /dev/null: cannot create this directory (File exists)"),
], ids=["rate", "nodes", "layout", "config", "fsdp2-layout", "rounds", "steps", "batch",
        "seq-len", "out-a-file"])
def test_bench_bad_input_is_one_line(args, message, capsys, monkeypatch):
    import zeropp.bench.run as run

    def no_runs(*a, **k):
        raise AssertionError("bad input was accepted: configurations were started")
    monkeypatch.setattr(run, "_run_one", no_runs)
    line = cli_error_line(["bench", *args], capsys)
    assert line.startswith("zeropp bench: ") and message in line, line


def test_bench_bad_input_from_the_command_line_is_one_line():
    r = _bench("--inter-node", "fast")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "unparsable link rate 'fast'" in lines[0], \
        r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(not OK, reason=f"no emulated cluster here: {WHY}")
def test_bench_smoke_2_nodes_x_1_rank_bytes_cross_and_nothing_is_left(tmp_path):
    """`zeropp bench` for real: 2 namespaces x 1 rank, 2 steps of zeropp; the
    link carried what the accounting says was sent (within 10% plus the
    barriers' and the store's small change), and no namespace is left."""
    r = _bench("--nodes", "2", "--node-size", "1", "--steps", "2", "--model", "small",
               "--configs", "zeropp", "--inter-node", "1gbit", "--compute-baseline",
               "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    results = json.loads((tmp_path / "bench.json").read_text())
    for res in results:
        tx, acct = res["wire_tx_bytes_per_node_step"], res["accounted_inter_bytes_per_node_step"]
        assert acct > 0 and 0.9 * tx <= acct <= tx, res
        # --compute-baseline: the unshaped run's step time, and the link time of the
        # busiest direction at 1 Gbit/s (= 125e6 bytes/s)
        rx = res["wire_rx_tx_bytes_per_node_step"] - tx
        assert res["compute_s"] > 0 and res["link_s"] == max(rx, tx) / 125e6, res
        # the phase bound: each phase's compute against its own link time
        fwd = res["accounted_forward_inter_bytes_per_node_step"]
        assert 0 < fwd < acct, res
        assert res["phase_bound_s"] == pytest.approx(
            phase_bound(res["compute_phases_s"], res["link_s"], fwd / acct)), res
        # ... its phases are the unshaped run's medians (forward / backward / optimizer)
        unshaped = json.loads((tmp_path / f"{res['config']}-compute.json").read_text())
        assert res["compute_phases_s"] == [statistics.median(p[i] for p in unshaped["phases_s"])
                                           for i in range(3)], res
        # the machine's CPU per timed step, by kind: some user time, every kind >= 0
        for cpu in (res["host_cpu_s_per_step"], res["compute_host_cpu_s_per_step"]):
            assert len(cpu) == 4 and cpu[0] > 0 and min(cpu) >= 0, res
    assert "| step / max(compute, link) | phase bound s | step / phase bound |" in r.stdout
    assert (tmp_path / "bench.png").exists()
    assert leftovers("zppb") == [] and leftovers("zppu") == []  # shaped and unshaped clusters


def test_phase_bound_sets_each_phase_against_its_own_traffic():
    """bench/run.py phase_bound, on round figures: a forward of 0.15 s of compute
    whose weight gathers take 0.675 s of link (3/4 of 0.90 s), a backward of 0.35 s
    against 0.225 s of gradients, 0.03 s of optimizer step: 0.675 + 0.35 + 0.03 =
    1.055 s, 1.17x max(compute 0.53, link 0.90) -- a step no overlap can bring to
    max(compute, link). With each phase's traffic under its compute, the bound is
    the compute."""
    assert phase_bound([0.15, 0.35, 0.03], 0.90, 0.75) == pytest.approx(1.055)
    assert phase_bound([0.2, 0.4, 0.05], 0.45, 1 / 3) == pytest.approx(0.65)


def test_each_rank_gets_torchruns_environment():
    """`zeropp bench` starts ranks itself (bench/run.py): at 2 x 2 rank 3 is node 1's
    second rank; on plain loopback all four ranks are one node's."""
    from zeropp.bench.run import rank_env
    e = rank_env(3, 2, 2, "10.77.0.1", 29601)
    assert {k: e[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                              "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1", "MASTER_ADDR": "10.77.0.1", "MASTER_PORT": "29601"}
    e = rank_env(3, 1, 4, "127.0.0.1", 5000)
    assert (e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) == ("3", "4", "0")


def test_bench_without_namespaces_or_deepspeed_says_each_in_one_line_and_runs_on_loopback(
        tmp_path, monkeypatch, capsys):
    import importlib.util

    import zeropp.bench.run as run
    from zeropp.cli.main import main
    real = importlib.util.find_spec
    monkeypatch.setattr(run.importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))
    monkeypatch.setattr(run, "available", lambda: (False, "network namespaces need root"))
    rc = main(["bench", "--nodes", "2", "--node-size", "1", "--steps", "1", "--model", "tiny",
               "--configs", "deepspeed-zero3,zeropp,deepspeed-hpz", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "no emulated cluster (network namespaces need root); running on plain loopback" in out
    assert ("zeropp bench: deepspeed-zero3, deepspeed-hpz skipped: DeepSpeed is not installed "
            "(DS_BUILD_OPS=0 pip install 'zeropp[bench]')") in out
    (res,) = json.loads((tmp_path / "bench.json").read_text())
    assert res["config"] == "zeropp" and res["link"] == "loopback"
    assert res["accounted_inter_bytes_per_node_step"] > 0


def test_bench_rounds_alternate_the_configurations_and_merge_every_step(tmp_path, monkeypatch,
                                                                        capsys):
    """--rounds 3: the configurations run in turn (A B A B A B), each world on a port
    of its own; a row's median is over the steps of every round, its byte figures
    the rounds' median, and one line says how often the fastest won round by round,
    with the ratios of the runner-up to it per round (the runs themselves stand in:
    this checks the bookkeeping; the smoke test above runs the worlds)."""
    import zeropp.bench.run as run
    from zeropp.cli.main import main
    step = {"zero3": [0.50, 0.60, 0.40], "zeropp": [0.45, 0.62, 0.38]}  # per round
    calls = []

    def one(cluster, port, cfg, ns, out):
        r = sum(c == cfg for _, c in calls)
        calls.append((port, cfg))
        t = step[cfg][r]
        return {"config": cfg, "median_step_s": t, "times": [t, t + 0.01], "final_loss": 2.0,
                "phases_s": [], "world": 2, "nodes": 2, "node_size": 1, "params": 1000,
                "wire_rx_tx_bytes_per_node_step": 0, "wire_tx_bytes_per_node_step": 0,
                "accounted_inter_bytes_per_node_step": 100 + r,
                "accounted_intra_bytes_per_node_step": 7, "peak_rss_mb": 100 + r}
    monkeypatch.setattr(run, "_run_one", one)
    monkeypatch.setattr(run, "available", lambda: (False, "network namespaces need root"))
    rc = main(["bench", "--nodes", "2", "--node-size", "1", "--configs", "zero3,zeropp",
               "--rounds", "3", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert calls == [(0, "zero3"), (1, "zeropp"), (2, "zero3"), (3, "zeropp"), (4, "zero3"),
                     (5, "zeropp")]
    zero3, zeropp = json.loads((tmp_path / "bench.json").read_text())
    assert zero3["median_step_s"] == pytest.approx(0.505)  # of 0.40 0.41 0.50 0.51 0.60 0.61
    assert zeropp["median_step_s"] == pytest.approx(0.455)
    assert zeropp["round_medians_s"] == [0.45, 0.62, 0.38]
    assert zeropp["accounted_inter_bytes_per_node_step"] == 101 and zeropp["peak_rss_mb"] == 102
    assert "Fastest (measured, loopback): Config.preset('zeropp') at 0.455 s/step" in out
    assert ("Rounds: zeropp fastest in 2 of 3; zero3 / zeropp by round 1.11, 0.97, 1.05 "
            "(median 1.05).") in out
    assert "in each of 3 rounds (configurations in turn)" in out
