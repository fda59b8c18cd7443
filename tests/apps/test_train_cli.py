"""`zeropp train`, the main job: bad input, outputs, Ctrl-C, skipped steps,
and the convergence check of ZeRO++ against ZeRO-3."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cases import cli_error_line, group_alive

from zeropp.cli.main import main

SMALL = ["--model", "tiny", "--seq-len", "32", "--batch", "4"]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zeropp", "train", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    (d / "empty.txt").write_text("   \n")
    (d / "short.txt").write_text("To be, or not to be.")
    (d / "bad.json").write_text('{"zero_optimization": {"stage": 3,')
    (d / "stage2.json").write_text('{"zero_optimization": {"stage": 2}}')
    (d / "hpz3.json").write_text('{"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}')
    return d


@pytest.mark.parametrize("args,message", [
    (["--data", "/no/such/file.txt"], "data file '/no/such/file.txt' does not exist"),
    (["--data", "{d}/empty.txt"], "is empty"),
    (["--data", "{d}/short.txt", "--seq-len", "64"], "sequences of 64 need at least"),
    (["--nproc", "3", "--node-size", "2"], "--nproc 3 must be a positive multiple of"),
    (["--model", "gpt-huge"], "unknown model preset 'gpt-huge'"),
    (["--deepspeed-config", "{d}/bad.json"], "is not valid JSON"),
    (["--deepspeed-config", "{d}/stage2.json"], "zero_optimization.stage=2"),
    (["--compare", "zero3,zero9"], "unknown configuration 'zero9'"),
    (["--clip", "-1"], "--clip must be more than 0"),
    (["--hpz", "3"], "hpZ's partition size 3 must divide the 4 ranks"),
    (["--deepspeed-config", "{d}/hpz3.json"], "hpZ's partition size 3 must divide the 4 ranks"),
    (["--sync-every", "8"], "--sync-every 8 does nothing without --replicas"),
    (["--replicas", "2", "--fragments", "2"], "--fragments 2 does nothing without --sync-every"),
    (["--out", "{d}/short.txt"], "short.txt: cannot create this directory (File exists)"),
    (["--deepspeed-config", "{d}/hpz3.json", "--compare", "zero3,zeropp"],
     "--deepspeed-config is the one configuration to run; it cannot be combined"),
], ids=["missing", "empty", "short", "nproc", "preset", "ds-json", "ds-stage", "compare",
        "clip", "hpz", "ds-hpz", "replica-only", "diloco-only", "out-file", "ds-compare"])
def test_bad_input_is_one_line_and_exit_2_without_traceback(files, args, message, capsys,
                                                           monkeypatch):
    # Input that got past the checks would reach the workers: that fails here at
    # once instead of training.
    import zeropp.cli.main

    def no_workers(*a, **k):
        raise AssertionError("bad input was accepted: the workers were started")
    monkeypatch.setattr(zeropp.cli.main, "spawn", no_workers)
    line = cli_error_line(["train", *[a.format(d=files) for a in args]], capsys)
    assert line.startswith("zeropp train: ") and message in line, line


@pytest.mark.parametrize("argv", [["export", "{d}/no-ckpt", "{d}/short.txt"],
                                  ["bench", "--configs", "zero3", "--out", "{d}/short.txt"]])
def test_an_output_directory_that_is_a_file_is_one_line(files, argv, capsys):
    # It was mkdir's FileExistsError traceback, from export and bench as from train.
    line = cli_error_line([a.format(d=files) for a in argv], capsys)
    assert line.endswith("short.txt: cannot create this directory (File exists)"), line


def test_flags_override_a_deepspeed_config_as_they_override_a_preset(files):
    # --no-qgz, --grad-bits 8 and --param-dtype bf16 were dropped without a word
    import argparse

    import torch

    from zeropp.cli.main import add_train_args, configs_from
    (files / "zpp.json").write_text('{"zero_optimization": {"stage": 3, "zero_quantized_weights"'
                                    ': true, "zero_quantized_gradients": true}}')
    p = argparse.ArgumentParser()
    add_train_args(p)
    ds = ["--deepspeed-config", str(files / "zpp.json")]
    (_, cfg), = configs_from(p.parse_args(ds))
    assert cfg.quantized_gradients and cfg.grad_bits == 4 and cfg.param_dtype is None
    (_, cfg), = configs_from(p.parse_args([*ds, "--no-qgz", "--grad-bits", "8",
                                           "--param-dtype", "bf16"]))
    assert (cfg.quantized_weights, cfg.quantized_gradients, cfg.grad_bits,
            cfg.param_dtype) == (True, False, 8, torch.bfloat16)


def test_every_text_the_split_accepts_gives_batches_of_both_parts():
    # At seq_len 32 the shortest text accepted had 66 tokens and a validation part of
    # 33: every worker then died in torch.randint ("from=0 >= to=0") at its first
    # evaluation (texts under 340 tokens). The shortest is 68 now, each part 34.
    import torch

    from zeropp.train.data import DataError, get_batch, split_tokens
    with pytest.raises(DataError, match="need at least 68"):
        split_tokens(torch.arange(67), 32)
    gen = torch.Generator().manual_seed(0)
    for n in range(68, 400):
        for part in split_tokens(torch.arange(n), 32):
            x, y = get_batch(part, 2, 32, gen)
            assert x.shape == y.shape == (2, 32) and torch.equal(x[:, 1:], y[:, :-1])


def test_validation_loss_is_the_eval_mode_loss_without_dropout(monkeypatch):
    # --hf-model gpt2 has dropout 0.1 and the evaluation ran in train mode: its val loss
    # was a dropout sample (5.4629 against 5.4504 without dropout, 2 steps of tiny).
    import torch

    from zeropp.train import loop
    from zeropp.train.model import GPT, GPTConfig
    monkeypatch.setattr(loop.dist, "all_reduce", lambda t: None)  # one rank
    a = loop.TrainArgs(batch=2, seq_len=16, eval_batches=3)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.5))
    val = torch.randint(0, 256, (200,))
    got = loop._val_loss(model, val, a, 0, 1)
    assert model.training  # as it was
    gen, model = torch.Generator().manual_seed(10_000), model.eval()
    with torch.no_grad():
        want = [model(*loop.get_batch(val, 2, 16, gen))[1].item() for _ in range(3)]
    assert got == sum(want) / 3


def test_bad_input_from_the_command_line_is_one_line_and_exit_2():
    r = _cli("--nproc", "3", "--node-size", "2")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("zeropp train: "), r.stderr
    assert "--nproc 3 must be a positive multiple of" in lines[0]
    assert "Traceback" not in r.stderr + r.stdout


def test_compare_zero3_and_zeropp_val_loss_within_2pct(tmp_path, capsys):
    """Same seed, corpus (Shakespeare bytes) and 60 steps at W=4 (2 nodes x 2):
    ZeRO++ with all three techniques ends within 2% of ZeRO-3's validation loss
    (measured: 3.0021 against 2.9664, +1.2%; at 100 steps 2.7363 against 2.7033)."""
    out = tmp_path / "cmp"
    rc = main(["train", *SMALL, "--steps", "60", "--eval-every", "30", "--lr", "3e-3",
               "--compare", "zero3,zeropp", "--out", str(out)])
    assert rc == 0
    rows = {n: json.loads((out / n / "summary.json").read_text()) for n in ("zero3", "zeropp")}
    z3, zpp = rows["zero3"]["final_val_loss"], rows["zeropp"]["final_val_loss"]
    assert zpp <= z3 * 1.02, (z3, zpp)
    assert z3 < 3.5  # it learnt: bytes start at ln(256) = 5.5
    assert rows["zeropp"]["vs_zero3_analytic"] < 0.26
    assert abs(rows["zero3"]["vs_zero3_analytic"] - 1) < 0.01
    for n in ("zero3", "zeropp"):
        metrics = [json.loads(x) for x in (out / n / "metrics.jsonl").read_text().splitlines()]
        assert len(metrics) == 60 and {"train_loss", "lr", "grad_norm", "step_time",
                                        "inter_node_bytes", "intra_node_bytes",
                                        "skipped"} <= set(metrics[0])
        assert sum("val_loss" in m for m in metrics) == 2
        assert json.loads((out / n / "config.json").read_text())["train"]["steps"] == 60
    assert (out / "compare.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "final val loss" in printed and str(out) in printed
    # the last line names the files where they are (the runs' in their own directories)
    assert printed.rstrip().splitlines()[-1] == (
        f"Files in {out}/: summary.md, loss plot compare.png; in each of zero3/, zeropp/: "
        "config.json, metrics.jsonl, summary.json, checkpoints/")
    assert (out / "summary.md").exists() and (out / "zeropp" / "checkpoints").is_dir()


@pytest.mark.parametrize("preset", ["zeropp", "zeropp-plus"])
def test_the_step_after_an_evaluation_counts_the_refresh_the_evaluation_sent(preset, tmp_path):
    """With hpZ an evaluation after a step refreshes the secondaries (zeropp: a world
    gather; zeropp-plus: qWD's deltas) and the next step sends no weight bytes across
    nodes: its row counts the evaluation's inter-node bytes, so every step after the
    first (a full gather) shows the same bytes, evaluation or not."""
    out = tmp_path / preset
    assert main(["train", *SMALL, "--steps", "6", "--eval-every", "2", "--preset", preset,
                 "--out", str(out)]) == 0
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum("val_loss" in m for m in metrics) == 3
    steady = {m["inter_node_bytes"] for m in metrics[1:]}
    assert len(steady) == 1 and steady.pop() > 0, [m["inter_node_bytes"] for m in metrics]


def test_zero3_with_accum_2_sends_the_analytic_zero3_bytes(tmp_path, capsys):
    """Each micro-batch gathers and reduce-scatters again: the analytic ZeRO-3 line
    counted one (1.07 MB for tiny), so zero3 itself read 2.000x ZeRO-3."""
    out = tmp_path / "accum"
    assert main(["train", *SMALL, "--steps", "2", "--accum", "2", "--preset", "zero3",
                 "--out", str(out)]) == 0
    assert abs(json.loads((out / "summary.json").read_text())["vs_zero3_analytic"] - 1) < 0.01
    assert "ZeRO-3's analytic inter-node bytes: 2.13 MB" in capsys.readouterr().out


def test_non_finite_steps_are_skipped_counted_and_the_run_goes_on(tmp_path):
    out = tmp_path / "nan"
    r = _cli(*SMALL, "--steps", "6", "--lr", "1e25", "--warmup", "1", "--clip", "1e30",
             "--eval-every", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 6 and metrics[-1]["skipped"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] == sum(m["skipped"] for m in metrics) >= 1
    assert "step skipped" in r.stdout
    assert "leaked" not in r.stderr, r.stderr[-800:]  # the fork server exits quietly


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _maps(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/maps").read_bytes()
    except OSError:
        return b""


def test_ctrl_c_and_sigterm_stop_every_worker_within_seconds(tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) and SIGTERM to the launcher alone
    (`kill`; it left RUN/tokens.pt and said nothing) once training runs; Ctrl-C 0.5 s
    after the fork server starts (a KeyboardInterrupt or FileNotFoundError traceback from
    the server or a worker it forked late: 6 of 8 Ctrl-Cs 1-8 s in); Ctrl-C while the
    launcher itself imports torch (Python's traceback, status -2); and Ctrl-C once 2
    replica groups of one rank train (`--replicas 2`: a KeyboardInterrupt traceback from
    each of their spawned workers). Each run stops within 10 s, says so in one line (status
    130 / 143), removes the workers' copy of the corpus and leaves no process (torchft's
    lighthouse included). The runs start together, each stopped as soon as it is ready."""
    runs = {}
    for how in ("import", "early", "term", "int", "replicas"):
        layout = ["--replicas", "2", "--node-size", "1"] if how == "replicas" else \
            ["--node-size", "2"]
        runs[how] = subprocess.Popen(
            [sys.executable, "-m", "zeropp", "train", *SMALL, "--nproc", "2", *layout,
             "--steps", "100000",
             "--out", str(tmp_path / how)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True)
    stopped = "interrupted; all workers stopped"
    said = {"import": (130, "zeropp train: interrupted while starting"),
            "early": (130, f"zeropp train: {stopped}"), "int": (130, f"zeropp train: {stopped}"),
            "replicas": (130, f"zeropp train: {stopped}"),
            "term": (143, "zeropp train: terminated (SIGTERM); all workers stopped")}

    def ready(how: str) -> bool:
        if how == "import":  # torch's library is loaded: its import has a second or more to go
            return b"libtorch" in _maps(runs[how].pid)
        if how == "early":
            return any(b"forkserver" in _cmdline(pid) for pid in group_alive(runs[how].pid))
        metrics = (tmp_path / how).glob("**/metrics.jsonl")  # (replica groups: replica*/)
        return any(m.read_text().count("\n") >= 1 for m in metrics)
    try:
        deadline, sent, ended = time.monotonic() + 120, {}, {}
        while len(ended) < len(runs):
            for how, p in runs.items():
                if how in sent:
                    if how not in ended and p.poll() is not None:
                        ended[how] = time.monotonic()
                    assert time.monotonic() - sent[how] < 10 or how in ended, f"{how}: still on"
                    continue
                assert time.monotonic() < deadline and p.poll() is None, f"{how}: never ready"
                if not ready(how):
                    continue
                if how == "early":  # (past `spawn`'s few ms with SIGINT blocked, in torch's import)
                    time.sleep(0.5)
                if how == "term":
                    os.kill(p.pid, signal.SIGTERM)
                else:
                    os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
                sent[how] = time.monotonic()
            time.sleep(0.01)
        for how, p in runs.items():
            _, err = p.communicate(timeout=15)
            assert (p.returncode, err.strip().splitlines()[-1]) == said[how], err[-2000:]
            assert "Traceback" not in err, err[-2000:]
            assert not (tmp_path / how / "tokens.pt").exists()  # the workers' copy of the corpus
        time.sleep(1)
        assert [group_alive(p.pid) for p in runs.values()] == [[]] * 5, "processes left behind"
    finally:
        for p in runs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


@pytest.mark.parametrize("orig_argv,argv,ours", [
    (["py", "/venv/bin/zeropp", "train"], ["/venv/bin/zeropp", "train"], True),
    (["py", "-W", "ignore", "-m", "zeropp", "train"], ["-m", "train"], True),
    # multiprocessing's "spawn" worker of the console script (`train --replicas`): it
    # copies the parent's sys.argv and never runs main(), so it kept the handler
    (["py", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()",
      "--multiprocessing-fork"], ["/venv/bin/zeropp", "train"], False),
    (["py", "-m", "zeropp.train", "--steps", "4"], ["-m", "--steps", "4"], False),  # torchrun's
    (["py", "script.py", "-m", "zeropp"], ["script.py", "-m", "zeropp"], False),
    (["py", "-c", "import zeropp", "-m", "zeropp"], ["-c", "-m", "zeropp"], False),
], ids=["script", "-m", "spawned", "-m-train", "args", "-c-args"])
def test_the_start_up_handler_is_for_zeropps_own_command_alone(orig_argv, argv, ours,
                                                                monkeypatch):
    """cli/quiet_start.py's test of the command line: its handler ends the process with
    no cleanup, so a process that never runs main() (which replaces it) must not get it."""
    from zeropp.cli import quiet_start
    monkeypatch.setattr(quiet_start, "_ARGV", orig_argv)
    monkeypatch.setattr(sys, "argv", argv)
    assert quiet_start._ours() is ours


def test_torchrun_launch_runs_the_same_job(tmp_path):
    out = tmp_path / "tr"
    torchrun = Path(sys.executable).with_name("torchrun")
    r = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m",
                        "zeropp.train", *SMALL, "--steps", "4", "--eval-every", "2", "--out",
                        str(out)], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4
    assert (out / "config.json").exists() and (out / "loss.png").exists()
    assert json.loads((out / "summary.json").read_text())["steps"] == 4  # as zeropp train's
    assert r.stdout.rstrip().endswith(f"Files in {out}/: config.json, metrics.jsonl, "
                                      "summary.json, checkpoints/, loss plot loss.png")
    assert not list(out.glob("tokens-node*.pt"))
    # The entry torchrun runs (`-m zeropp.train`) again under `zeropp launch`, which sets
    # torchrun's environment and forks from a server that imported it (7.2 s against 4.3 s
    # a launch, unloaded). The same command again, 2 steps longer: it continues the run,
    # as `zeropp train` does (it started over at step 0, rewriting metrics.jsonl and the
    # checkpoints).
    entry = tmp_path / "entry.py"
    entry.write_text('import runpy\nrunpy.run_module("zeropp.train", run_name="__main__")\n')

    def again(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "zeropp", "launch", "--nproc", "2",
                               "--preload", "zeropp.train", str(entry), *SMALL, *args],
                              capture_output=True, text=True, timeout=180)
    first = (out / "metrics.jsonl").read_text().splitlines()
    r = again("--steps", "6", "--eval-every", "2", "--out", str(out))
    assert r.returncode == 0 and "resuming it from step_000004" in r.stderr, r.stderr[-2000:]
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert rows[:4] == first and [json.loads(x)["step"] for x in rows] == list(range(6))
    # Bad input read by each node's first rank: one line from rank 0, every rank exits 2
    # (rank 1 died in a broadcast with a connection-reset traceback); the launcher names
    # rank 1's status in one line, without a traceback of its own
    r = again("--data", "/no/such.txt", "--out", str(tmp_path / "bad"))
    assert "zeropp.train: data file '/no/such.txt' does not exist" in r.stderr, r.stderr[-2000:]
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "exited with status 2" in r.stderr, r.stderr
