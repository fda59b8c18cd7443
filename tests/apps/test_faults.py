"""The main job under faults: a world dies with its launcher, a run
directory belongs to one world, the same command run again continues the run,
a damaged newest checkpoint falls back to the newest one that verifies, and a
crash reads as one line. Each run is compared bit for bit with one that was
never interrupted (benchmarks/conformance/soak.py does the same at random, many times)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cases import cli_error_line, group_alive, kill_session

from zeropp.cli.main import main
from zeropp.train.resume import differences

# 40 steps at W=4 as 2 x 2 (a world orphaned at step 16 would finish the run: the last
# checkpoint shows it), a checkpoint every 8, none pruned
STEPS, EVERY = 40, 8
CMD = ["--model", "tiny", "--seq-len", "32", "--batch", "4", "--nproc", "4", "--node-size",
       "2", "--eval-every", "8", "--eval-batches", "2", "--steps", str(STEPS), "--save-every",
       str(EVERY), "--keep-checkpoints", "100"]
LAST = f"checkpoints/step_{STEPS:06d}"


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _same_numbers(a: list[dict], b: list[dict]) -> bool:
    # (not the byte counts: the first step after a load counts no evaluation's refresh)
    keys = ("step", "train_loss", "grad_norm", "lr", "val_loss", "skipped")
    return [[r.get(k) for k in keys] for r in a] == [[r.get(k) for k in keys] for r in b]


def _snapshot(run: Path) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*")
            if p.exists()}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted run every other one is compared with."""
    run = tmp_path_factory.mktemp("straight") / "run"
    assert main(["train", *CMD, "--out", str(run)]) == 0
    return run


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict:
    """`zeropp train` in its own session, SIGKILLed (the launcher alone) once
    step_000016 is saved: how long its world lived on, and the run directory
    then and 2 s later."""
    run = tmp_path_factory.mktemp("killed") / "run"
    p = subprocess.Popen([sys.executable, "-m", "zeropp", "train", *CMD, "--out", str(run)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        latest = run / "checkpoints" / "latest"  # written last, after step_000016's renames
        while not (latest.exists() and latest.read_text().strip() == "step_000016"):
            assert p.poll() is None and time.monotonic() < deadline, "never reached step 16"
            time.sleep(0.01)
        gone_s = kill_session(p, within=30)
        before = _snapshot(run)
        time.sleep(2)
        return {"run": run, "gone_s": gone_s, "left": group_alive(p.pid), "before": before,
                "after": _snapshot(run), "checkpoints": sorted(
                    x.name for x in (run / "checkpoints").glob("step_*"))}
    finally:
        for pid in group_alive(p.pid):
            os.kill(pid, signal.SIGKILL)


def test_sigkill_of_the_launcher_ends_its_world_within_5_s_and_the_run_stops(killed):
    assert killed["left"] == [], "processes of the killed launcher's world still run"
    assert killed["gone_s"] < 5.0, killed["gone_s"]
    assert killed["before"] == killed["after"], "the run directory still changes"
    assert LAST.split("/")[1] not in killed["checkpoints"]  # it died: it did not finish


def test_the_same_command_after_a_kill_continues_the_run_bit_for_bit(killed, straight,
                                                                     capsys):
    """Run again as it was: every step once, in order; no checkpoint deleted; the
    same losses and final rank files as the run never killed."""
    run = killed["run"]
    assert main(["train", *CMD, "--out", str(run)]) == 0
    err = capsys.readouterr().err
    assert f"{run} already holds this run: resuming it from {killed['checkpoints'][-1]}" \
        in err, err
    assert [r["step"] for r in _rows(run)] == list(range(STEPS))
    assert _same_numbers(_rows(run), _rows(straight))
    left = sorted(x.name for x in (run / "checkpoints").glob("step_*"))
    assert set(killed["checkpoints"]) <= set(left), (killed["checkpoints"], left)
    assert differences(run / LAST, straight / LAST) == []


def test_a_truncated_rank_file_in_the_newest_checkpoint_resumes_from_the_one_before(
        straight, tmp_path, capfd):
    """The run as it stood at step 16 (later checkpoints and rows removed), then
    rank 1's file of step_000016 cut in half: `--resume RUN` names the skipped
    checkpoint in one line, keeps it as step_000016.damaged, continues from
    step_000008 and ends bit for bit equal."""
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    for ck in (run / "checkpoints").glob("step_*"):
        if int(ck.name[5:]) > 16:
            shutil.rmtree(ck)
    (run / "checkpoints" / "latest").write_text("step_000016\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(run)[:16]))
    f = run / "checkpoints" / "step_000016" / "rank00001.safetensors"
    size = f.stat().st_size
    os.truncate(f, size // 2)
    assert main(["train", *CMD, "--resume", str(run)]) == 0
    err = capfd.readouterr().err
    skip = [ln for ln in err.splitlines() if "skipping" in ln]
    assert skip == [f"zeropp train: skipping damaged checkpoint step_000016 ({f}: {size // 2} "
                    f"bytes, the manifest says {size} (truncated or replaced)); kept as "
                    "step_000016.damaged"], err
    from zeropp.train.resume import verify_checkpoint
    verify_checkpoint(run / "checkpoints" / "step_000016")  # saved again: it ran from step 8
    assert (run / "checkpoints" / "step_000016.damaged").is_dir()
    assert _same_numbers(_rows(run), _rows(straight))
    assert differences(run / LAST, straight / LAST) == []


def test_a_damaged_checkpoint_named_by_resume_is_one_line_and_status_2(straight, tmp_path,
                                                                      capsys):
    ck = tmp_path / "step_000016"
    shutil.copytree(straight / "checkpoints" / "step_000016", ck)
    (ck / "rank00002.safetensors").unlink()
    line = cli_error_line(["train", *CMD, "--resume", str(ck), "--out", str(tmp_path / "o")],
                          capsys)
    assert line == f"zeropp train: {ck / 'rank00002.safetensors'}: missing (the manifest lists it)"


def test_a_second_world_on_a_run_directory_is_refused_in_one_line(tmp_path, capsys):
    from zeropp.train.lock import RunLock
    run = tmp_path / "run"
    run.mkdir()
    with RunLock(run):  # a live owner: this process, through another open file
        line = cli_error_line(["train", *CMD, "--out", str(run)], capsys)
    assert line.startswith(f"zeropp train: {run} is in use by zeropp train (pid {os.getpid()} "
                           "on host "), line
    assert line.endswith("wait for it to end or stop it (one world per run directory)")


def test_a_lock_left_by_a_dead_launcher_is_taken_over(tmp_path):
    from zeropp.train.lock import RunLock
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                       capture_output=True, text=True, check=True)
    (tmp_path / ".lock").write_text(json.dumps({"host": os.uname().nodename,
                                                "pid": int(p.stdout), "since": 0}))
    with RunLock(tmp_path):
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()


def _rank_1_dies_at_step_3(a, cfg, run_dir: str, tokens: str, vocab: int) -> dict:
    import torch.distributed as dist

    from zeropp.cli.launch import at_step
    at_step(3)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 gets gloo's "connection closed by peer" traceback here
    raise AssertionError("unreachable")


def test_a_crash_after_the_restarts_is_one_line_and_the_path_of_its_tracebacks(
        tmp_path, capfd, monkeypatch):
    """A world whose rank 1 always dies: one short restart line, then one line
    naming rank, signal and step and RUN/failures.log, which holds both
    attempts' tracebacks (gloo's text among them); status 1."""
    import zeropp.cli.main
    monkeypatch.setattr(zeropp.cli.main, "train_worker", _rank_1_dies_at_step_3)
    run = tmp_path / "run"
    rc = main(["train", "--model", "tiny", "--seq-len", "32", "--nproc", "2", "--node-size",
               "1", "--max-restarts", "1", "--out", str(run)])
    assert rc == 1
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("zeropp")]
    assert lines == [
        "zeropp: rank 1 died (killed by SIGKILL) at step 3; restarting all 2 workers "
        "(restart 1 of 1)",
        f"zeropp train failed after 1 restart(s): rank 1 died (killed by SIGKILL) at step 3; "
        f"tracebacks in {run / 'failures.log'}"], lines
    log = (run / "failures.log").read_text()
    assert log.count("=== ") == 2 and "Traceback" in log


def test_out_on_a_run_with_other_settings_is_refused_in_one_line(straight, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    before = _snapshot(run)
    line = cli_error_line(["train", *CMD, "--seed", "1", "--out", str(run)], capsys)
    assert line.startswith(f"zeropp train: --out {run} already holds a run that cannot be "
                           "resumed with these options ("), line
    assert "seed: 0 -> 1" in line and line.endswith("; choose another --out")
    assert {k: v for k, v in _snapshot(run).items() if not k.endswith(".lock")} == \
           {k: v for k, v in before.items() if not k.endswith(".lock")}  # nothing touched


def test_resume_under_another_preset_is_refused_in_one_line(straight, tmp_path, capsys):
    """A zeropp-plus run resumed under zero3 would continue with other numbers from
    step 40 on: refused, naming each setting that differs, nothing touched."""
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    before = _snapshot(run)
    line = cli_error_line(["train", *CMD, "--preset", "zero3", "--resume", str(run)], capsys)
    assert line == (f"zeropp train: --resume {run / LAST}: the ZeRO++ settings differ from the "
                    "checkpoint's (quantized_weights: True -> False; hpz_partition_size: 2 -> 1; "
                    "quantized_gradients: True -> False; gradient_error_feedback: True -> False; "
                    "hierarchical_gather: True -> False; weight_delta: True -> False)")
    assert {k: v for k, v in _snapshot(run).items() if not k.endswith(".lock")} == \
           {k: v for k, v in before.items() if not k.endswith(".lock")}


def test_resume_into_an_out_holding_another_runs_checkpoints_is_refused(straight, tmp_path,
                                                                        capsys):
    """A restart before the resumed run's first save would continue from --out's own
    `latest`, another run's: refused in one line, nothing touched."""
    other = tmp_path / "other"
    shutil.copytree(straight, other)
    before = _snapshot(other)
    line = cli_error_line(["train", *CMD, "--resume", str(straight), "--out", str(other)], capsys)
    assert line == (f"zeropp train: --out {other} holds checkpoints of another run; --resume "
                    f"{straight} continues into an empty --out, or into its own run directory")
    assert {k: v for k, v in _snapshot(other).items() if not k.endswith(".lock")} == \
           {k: v for k, v in before.items() if not k.endswith(".lock")}


def test_resume_of_a_finished_run_into_a_new_out_is_one_line(straight, tmp_path, capsys):
    """Its checkpoint at step 40 of --steps 40: the workers ran no step, and the
    launcher's summary of no rows was an IndexError traceback."""
    line = cli_error_line(["train", *CMD, "--resume", str(straight), "--out",
                           str(tmp_path / "o")], capsys)
    assert line == (f"zeropp train: --resume {straight / LAST} is at step 40: --steps 40 "
                    "leaves nothing to train")


def test_compare_on_a_directory_holding_a_comparison_is_refused_in_one_line(straight,
                                                                           tmp_path, capsys):
    shutil.copytree(straight, tmp_path / "cmp" / "zero3")
    line = cli_error_line(["train", *CMD, "--compare", "zero3,zeropp", "--out",
                           str(tmp_path / "cmp")], capsys)
    assert line == (f"zeropp train: --out {tmp_path / 'cmp'} already holds runs of a "
                    "comparison, which is not resumed; choose another --out")
    assert [r["step"] for r in _rows(tmp_path / "cmp" / "zero3")] == list(range(STEPS))
