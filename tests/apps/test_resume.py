"""Resuming the main job: `zeropp train --resume`, and the launcher restarting
workers after one is SIGKILLed, both continuing bit for bit."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import torch
from cases import calm_and_crash

from zeropp.cli.main import main
from zeropp.config import named
from zeropp.train.loop import TrainArgs, train_worker

SMALL = ["--model", "tiny", "--seq-len", "32", "--batch", "4", "--nproc", "4",
         "--node-size", "2", "--eval-every", "4", "--eval-batches", "2"]


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _dies_at_step_8_once(a: TrainArgs, cfg, run_dir: str, tokens: str, vocab: int) -> dict:
    """train_worker, but on the first attempt rank 1 SIGKILLs itself at step 8."""
    import zeropp.train.loop as loop
    if torch.distributed.get_rank() == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        def at_step(step: int, record=loop.at_step) -> None:
            if step == 8:
                os.kill(os.getpid(), signal.SIGKILL)
            record(step)
        loop.at_step = at_step
    return train_worker(a, cfg, run_dir, tokens, vocab)


def test_train_resume_continues_with_the_same_losses(tmp_path, monkeypatch):
    """`--resume RUN/checkpoints/step_000006` in the run's own directory, its step_000012
    still there, and rank 1 killed at step 8, before the resumed run's first save: the
    restart continues from step_000006 (which the resume made `latest`), not from the
    abandoned step_000012, and every step's numbers are the uninterrupted run's."""
    import zeropp.cli.main
    a = tmp_path / "a"
    assert main(["train", *SMALL, "--steps", "12", "--save-every", "6", "--out", str(a)]) == 0
    assert (a / "checkpoints" / "latest").read_text().strip() == "step_000012"
    straight = _rows(a)
    monkeypatch.setattr(zeropp.cli.main, "train_worker", _dies_at_step_8_once)
    assert main(["train", *SMALL, "--steps", "12", "--save-every", "6", "--max-restarts", "1",
                 "--resume", str(a / "checkpoints" / "step_000006")]) == 0
    resumed = _rows(a)
    assert [r["step"] for r in resumed] == list(range(12))
    for s, r in zip(straight, resumed):
        assert (s["train_loss"], s["grad_norm"], s.get("val_loss")) == \
               (r["train_loss"], r["grad_norm"], r.get("val_loss"))


def _die_once_after(a: TrainArgs, cfg, run_dir: str, tokens: str, vocab: int,
                    after: str) -> dict:
    """train_worker, but on the first attempt rank 1 SIGKILLs itself as soon as
    checkpoint `after` is the run's latest (mid-run: the next one is 5 steps on)."""
    latest = Path(run_dir) / "checkpoints" / "latest"
    if torch.distributed.get_rank() == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        def watch() -> None:
            while not (latest.exists() and latest.read_text().strip() == after):
                time.sleep(0.002)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=watch, daemon=True).start()
    return train_worker(a, cfg, run_dir, tokens, vocab)


def test_a_sigkilled_worker_is_restarted_and_the_run_ends_with_the_same_loss(tmp_path, capfd):
    a = TrainArgs(model="tiny", seq_len=32, batch=4, steps=20, save_every=5, eval_every=10,
                  eval_batches=2)
    calm, crash = calm_and_crash(tmp_path, a, named("zeropp", 2), _die_once_after,
                                 "step_000010")
    err = capfd.readouterr()
    assert "rank 1 died (killed by SIGKILL)" in err.err and "restarting all 4 workers (restart 1 of 1)" in err.err
    assert crash["start_step"] == 10 and calm["start_step"] == 0  # resumed, not restarted
    last_calm, last_crash = calm["history"][-1], crash["history"][-1]
    assert last_crash["step"] == 19
    assert last_crash["train_loss"] == last_calm["train_loss"]
    assert last_crash["val_loss"] == last_calm["val_loss"]
    assert [r["step"] for r in crash["history"]] == list(range(20))


def _fake_checkpoint(run: Path, step: int) -> None:
    d = run / "checkpoints" / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text("{}")


def test_pruning_keeps_the_newest_and_never_later_steps_of_an_abandoned_timeline(tmp_path):
    from zeropp.train import resume
    for s in (5, 10, 15, 40):  # 40: a later run's, before resuming from 15
        _fake_checkpoint(tmp_path, s)
    _fake_checkpoint(tmp_path, 20)
    resume.after_save(tmp_path, "step_000020", keep=2)
    left = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert left == ["step_000015", "step_000020", "step_000040"]
    assert resume.latest(tmp_path).name == "step_000020"


def test_latest_ignores_a_pointer_outside_the_run_and_falls_back_to_the_newest(tmp_path):
    from zeropp.train import resume
    _fake_checkpoint(tmp_path, 5)
    _fake_checkpoint(tmp_path, 10)
    ptr = tmp_path / "checkpoints" / "latest"
    ptr.write_text("../../elsewhere\n")
    assert resume.latest(tmp_path).name == "step_000010"
    ptr.write_text("step_000099\n")  # named but gone
    assert resume.latest(tmp_path).name == "step_000010"


def _damage_then_die(a: TrainArgs, cfg, run_dir: str, tokens: str, vocab: int,
                     after: str) -> dict:
    """train_worker, but on the first attempt rank 1 cuts its own file of checkpoint
    `after` in half as soon as that is the run's latest, then SIGKILLs itself."""
    ckpt = Path(run_dir) / "checkpoints"
    if torch.distributed.get_rank() == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        def watch() -> None:
            while not ((ckpt / "latest").exists()
                       and (ckpt / "latest").read_text().strip() == after):
                time.sleep(0.002)
            f = ckpt / after / "rank00001.safetensors"
            os.truncate(f, f.stat().st_size // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=watch, daemon=True).start()
    return train_worker(a, cfg, run_dir, tokens, vocab)


def test_a_restart_skips_a_damaged_newest_checkpoint_without_spending_a_restart(tmp_path,
                                                                                capfd):
    """Rank 1 dies right after cutting its file of step_000010: the one restart
    finds step_000010 damaged, sets it aside as step_000010.damaged, resumes from
    step_000005 and ends with the same losses, every step once."""
    a = TrainArgs(model="tiny", seq_len=32, batch=4, steps=20, save_every=5, eval_every=10,
                  eval_batches=2, keep_checkpoints=3)
    calm, crash = calm_and_crash(tmp_path, a, named("zeropp", 2), _damage_then_die,
                                 "step_000010")
    err = capfd.readouterr().err
    assert err.count("restarting all 4 workers") == 1, err
    assert crash["start_step"] == 5
    assert (tmp_path / "crash" / "checkpoints" / "step_000010.damaged").is_dir()
    assert [r["step"] for r in crash["history"]] == list(range(20))
    assert [(r["train_loss"], r["grad_norm"]) for r in crash["history"]] == \
           [(r["train_loss"], r["grad_norm"]) for r in calm["history"]]
    assert [r["step"] for r in _rows(tmp_path / "crash")] == list(range(20))
