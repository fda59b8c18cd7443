"""The spawn helper: results by rank, failures surface fast with the traceback."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from zeropp.cli.launch import WorkerError, spawn


def _rank_info():
    t = torch.tensor([dist.get_rank()], dtype=torch.float32)
    dist.all_reduce(t)
    return dist.get_rank(), int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]), t.item()


def _raise_on_rank_1(pidfile: str):
    if dist.get_rank() == 0:  # a child of its own, as a DataLoader worker is
        import subprocess
        child = subprocess.Popen(["sleep", "120"])
        with open(pidfile + ".tmp", "w") as f:
            f.write(str(child.pid))
        os.replace(pidfile + ".tmp", pidfile)
        time.sleep(120)  # until the launcher kills it
    while not os.path.exists(pidfile):
        time.sleep(0.01)
    raise ValueError("boom from rank one")


def _hang():
    time.sleep(600)


def test_results_come_back_in_rank_order_with_node_layout():
    out = spawn(_rank_info, 4, 2, timeout=60)
    assert out == [(0, 0, 2, 6.0), (1, 1, 2, 6.0), (2, 0, 2, 6.0), (3, 1, 2, 6.0)]


def _heap():
    import gc
    return gc.get_freeze_count(), "torch._dynamo" in sys.modules


def test_workers_start_with_the_servers_imported_heap_frozen():
    """The fork server imports torch, torch._dynamo and zeropp, then freezes what it
    made (zeropp/_frozen_heap.py): a worker's garbage collector never walks those
    objects, so its first full collection does not copy the server's pages (1.2-2 s
    per rank before, with transformers and TRL imported). torch alone leaves over
    100,000 objects to freeze."""
    out = spawn(_heap, 2, timeout=60)
    assert all(frozen > 100_000 and dynamo for frozen, dynamo in out), out


def test_failing_rank_traceback_is_raised_within_seconds(tmp_path):
    t0 = time.monotonic()
    pidfile = str(tmp_path / "child")
    with pytest.raises(WorkerError, match="rank 1 raised") as e:
        spawn(_raise_on_rank_1, 2, args=(pidfile,), timeout=120)
    assert "boom from rank one" in str(e.value)
    assert time.monotonic() - t0 < 30
    # The killed rank 0's own child went with it (it lived on, orphaned: a script's
    # DataLoader workers did for 5 s after a Ctrl-C of `zeropp launch`)
    with open(f"/proc/{int(open(pidfile).read())}/stat") as f:
        assert f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_hung_world_is_killed_at_the_timeout_after_each_ranks_stacks_in_turn(capfd):
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="did not finish within 3s"):
        spawn(_hang, 2, timeout=3)
    assert time.monotonic() - t0 < 20
    # each rank's dump whole under its own heading (sent at once, they interleaved)
    dumps = capfd.readouterr().err.split("--- rank ")[1:]
    assert [d.split("'")[0] for d in dumps] == ["0", "1"]
    assert all("most recent call first" in d and "in _hang" in d for d in dumps), dumps


def test_node_size_must_divide_world_size():
    with pytest.raises(ValueError, match="node_size=3"):
        spawn(_hang, 4, 3)


_PROBE = """
import os, sys
preloaded = "xml.dom.minidom" in sys.modules and "transformers" in sys.modules
preloaded &= __import__("gc").get_freeze_count() > 100_000  # the launcher froze them
import deepspeed  # no install_as_deepspeed() line: the launcher's flag made it answer
from transformers.integrations import is_deepspeed_available
os.write(1, f"rank {os.environ['RANK']} {preloaded} {deepspeed.initialize.__module__} "
            f"{is_deepspeed_available()}\\n".encode())  # one write(2): lines do not interleave
"""


def test_launch_preload_and_as_deepspeed_run_an_unmodified_deepspeed_script(tmp_path):
    """`zeropp launch --as-deepspeed --preload xml.dom.minidom,transformers`: every rank
    starts with both imported (it forked from the server that imported them), a script
    that imports deepspeed without the install line gets zeropp's, and transformers,
    imported after the install, reports DeepSpeed available. A module that does not
    exist, or one that raises when imported, is named, exit status 2."""
    import subprocess
    import sys
    pytest.importorskip("transformers")
    script = tmp_path / "ds_script.py"
    script.write_text(_PROBE)
    run = [sys.executable, "-m", "zeropp", "launch", "--nproc", "2", "--timeout", "120"]
    r = subprocess.run([*run, "--as-deepspeed", "--preload", "xml.dom.minidom,transformers",
                        str(script)], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(r.stdout.split("\n")[:2]) == [
        f"rank {i} True zeropp.deepspeed.compat True" for i in (0, 1)], r.stdout
    bad = subprocess.run([*run, "--preload", "json,no_such_module_zpp", str(script)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no module named 'no_such_module_zpp'" in bad.stderr, bad.stderr
    (tmp_path / "raises_zpp.py").write_text("raise OSError('no disk here')\n")
    bad = subprocess.run([*run, "--preload", "raises_zpp", str(script)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))})
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "zeropp launch: --preload: preload 'raises_zpp' failed to import: OSError: no disk "
        "here"), bad.stderr


_RENDEZVOUS = """
import os, sys, torch, torch.distributed as dist
from torch.utils.data import DataLoader
dist.init_process_group("gloo")
# one batch through a loader worker: a rank that was a daemonic process could start none
t = torch.ones(1) * len(list(DataLoader(range(1), num_workers=1)))
dist.all_reduce(t)
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
if attempt == "0" and sys.argv[1] == "fail-once" and dist.get_rank() == 1:
    sys.exit(3)
os.write(1, f"rank {dist.get_rank()} attempt {attempt} sum {int(t.item())}\\n".encode())
"""


def test_launch_restarts_meet_in_a_fresh_store_and_concurrent_launches_do_not_collide(tmp_path):
    """`zeropp launch` hosts each attempt's rendezvous store itself (torchrun's agent
    store): a world restarted after rank 1 exits with status 3 meets again and
    all-reduces (sum 2 on both ranks, attempt 1), and two launches started at the same
    moment each complete."""
    import subprocess
    import sys
    script = tmp_path / "rdzv.py"
    script.write_text(_RENDEZVOUS)
    run = [sys.executable, "-m", "zeropp", "launch", "--nproc", "2", "--timeout", "120"]
    r = subprocess.run([*run, "--max-restarts", "1", str(script), "fail-once"],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "restarting all 2 workers (restart 1 of 1)" in r.stderr, r.stderr[-2000:]
    for rank in (0, 1):
        assert f"rank {rank} attempt 1 sum 2" in r.stdout, r.stdout
    both = [subprocess.Popen([*run, str(script), "plain"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in both:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-2000:]
        assert sorted(out.splitlines()) == ["rank 0 attempt 0 sum 2", "rank 1 attempt 0 sum 2"]


_EXIT_AFTER_UNWAITED = """
import sys, torch, torch.distributed as dist, torch.multiprocessing as mp
def body(rank, init):
    import zeropp  # noqa: F401  (its exit grace: collectives.py)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=3)
    out = [torch.empty(1) for _ in range(3)]
    dist.group.WORLD.allgather([out], [torch.tensor([float(rank)])])  # never waited
if __name__ == "__main__":
    # a file store, not a port: no port to race for with tests running beside it
    mp.spawn(body, args=("file://" + sys.argv[1],), nprocs=3)
"""


def test_a_rank_exiting_right_after_a_gloo_collective_does_not_abort(tmp_path):
    """Ranks that exit normally (as under torchrun) with a gloo worker thread still
    holding a collective's tensors: without zeropp's exit grace the thread frees them
    while the interpreter finalizes and the rank aborts ("terminate called without an
    active exception"; measured: 10 of 14 runs of this script without the grace,
    0 of 14 with it, half of each with both cores loaded; with the file store, 3 of 6
    without and 0 of 6 with, beside a loaded suite run). Two runs, each of three
    fresh interpreters; without the grace both pass about 1 time in 4 to 10."""
    import subprocess
    script = tmp_path / "exit_after_unwaited.py"
    script.write_text(_EXIT_AFTER_UNWAITED)
    for k in range(2):
        r = subprocess.run([sys.executable, str(script), str(tmp_path / f"init{k}")],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]


def _dies_at_step_3():
    from zeropp.cli.launch import at_step
    at_step(3)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), 9)
    dist.barrier()  # rank 0 meets gloo's "connection closed by peer" here


def test_a_restart_is_announced_in_one_short_line_and_every_failure_is_logged(tmp_path,
                                                                              capfd):
    log = tmp_path / "failures.log"
    with pytest.raises(WorkerError) as e:
        spawn(_dies_at_step_3, 2, timeout=120, max_restarts=1, log=str(log))
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("zeropp:")]
    assert err == ["zeropp: rank 1 died (killed by SIGKILL) at step 3; restarting all 2 "
                   "workers (restart 1 of 1)"], err
    assert e.value.short == "rank 1 died (killed by SIGKILL) at step 3"
    assert log.read_text().count("=== ") == 2  # both attempts, with their tracebacks


def _refuses_to_restart():
    from zeropp.cli.launch import no_restart
    if dist.get_rank() == 0:
        raise no_restart(ValueError("a checkpoint no restart can read"))
    dist.barrier()


def test_an_error_marked_no_restart_ends_the_run_without_spending_restarts(capfd):
    with pytest.raises(WorkerError) as e:
        spawn(_refuses_to_restart, 2, timeout=120, max_restarts=2)
    assert e.value.fatal
    assert e.value.short == "rank 0 raised ValueError: a checkpoint no restart can read"
    assert "restarting" not in capfd.readouterr().err


_FOREVER = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
while True:
    t = torch.ones(1)
    dist.all_reduce(t)
    with open(sys.argv[1], "a") as f:
        f.write(f"{dist.get_rank()}\\n")
    time.sleep(0.05)
"""


def test_sigkill_of_zeropp_launch_ends_its_world_within_5_s(tmp_path):
    """Under `zeropp launch` the ranks are the launcher's own children (start="fork"):
    a SIGKILLed launcher leaves no process of its session within 5 s, and the ranks'
    file stops growing."""
    import signal
    import subprocess

    from cases import group_alive, kill_session
    script, beat = tmp_path / "forever.py", tmp_path / "beat"
    script.write_text(_FOREVER)
    p = subprocess.Popen([sys.executable, "-m", "zeropp", "launch", "--nproc", "2",
                          str(script), str(beat)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)

    try:
        deadline = time.monotonic() + 120
        while not (beat.exists() and beat.read_text().count("\n") >= 4):
            assert p.poll() is None and time.monotonic() < deadline, "never started"
            time.sleep(0.05)
        kill_session(p, within=5)
        assert group_alive(p.pid) == []
        size = beat.stat().st_size
        time.sleep(0.5)
        assert beat.stat().st_size == size
    finally:
        for pid in group_alive(p.pid):
            os.kill(pid, signal.SIGKILL)
