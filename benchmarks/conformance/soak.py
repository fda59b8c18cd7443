"""Random-kill soak of `zeropp train`: each trial runs the main job,
hurts it once, lets it recover, and compares the result with a run that was
never hurt, bit for bit.

    python benchmarks/conformance/soak.py --trials 28 --steps 60 --out /tmp/soak

Kinds of hurt, taken in turn (presets alternate between trials):
  worker            SIGKILL one worker at a random time (once a random number of
                    metrics rows is written)
  save:files        SIGKILL one worker while the ranks write a checkpoint's files
                    (`.step_N.partial` exists, no manifest yet)
  save:manifest     ... once the manifest is in `.step_N.partial` (before the rename)
  save:pointer      ... once step_N is in place but `latest` still names the one before
  launcher          SIGKILL the launcher at a random time (the same); its world must be gone in
                    5 s; then the same command again (it resumes the run)
  truncate          cut a rank file of the newest checkpoint in half, then SIGKILL a
                    worker: the restart must skip that checkpoint
  delete            delete a rank file of the newest checkpoint, then the same

The kill points are found by polling the run directory every ~0.5 ms, so the
stage a kill lands in is the one seen just before it, not a guarantee.

Each trial passes when: the run exits 0 (after the relaunch, for `launcher`);
metrics.jsonl holds every step once, in order, with the losses, grad norms,
learning rates and validation losses of the undisturbed run; the final
checkpoint's rank files equal the undisturbed run's (train.resume.differences:
every tensor, the metadata less the OS-seeded Python/NumPy RNG states); the
newest `--keep-checkpoints` checkpoints are there and verify; no process of the
trial's session is left. A damaged checkpoint must have been set aside as
`step_N.damaged`, and in no other trial may one appear.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from zeropp.train.resume import differences, verify_checkpoint

KINDS = ["worker", "save:files", "save:manifest", "save:pointer", "launcher", "truncate",
         "delete"]
KEYS = ("step", "train_loss", "grad_norm", "lr", "val_loss", "skipped")


def command(a: argparse.Namespace, preset: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "zeropp", "train", "--model", "tiny", "--seq-len", "32",
            "--batch", "4", "--nproc", "4", "--node-size", "2", "--steps", str(a.steps),
            "--save-every", str(a.save_every), "--eval-every", "10", "--eval-batches", "2",
            "--max-restarts", "3", "--preset", preset, "--out", str(out)]


def session(pgid: int) -> dict[int, tuple[int, str]]:
    """Live processes of a session: pid -> (parent pid, command line)."""
    procs = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        f = stat[stat.rindex(")") + 2:].split()
        if int(f[3]) == pgid and f[0] != "Z":  # f[3]: the session id
            procs[int(pid)] = (int(f[1]), cmd)
    return procs


def workers(launcher: int) -> list[int]:
    """The training ranks: children of the launcher's fork server."""
    procs = session(launcher)
    servers = {p for p, (pp, cmd) in procs.items() if pp == launcher and "forkserver" in cmd}
    return [p for p, (pp, _) in procs.items() if pp in servers]


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def written(run: Path) -> int:
    """Complete metrics rows so far (the writer may be in the middle of one)."""
    try:
        return (run / "metrics.jsonl").read_text().count("\n")
    except OSError:
        return 0


def stage(ck: Path, kind: str) -> bool:
    """Is a save at the stage `kind` aims at, right now?"""
    try:
        names = os.listdir(ck)
        partial = [n for n in names if n.endswith(".partial")]
        if kind == "save:files":
            return any(not (ck / p / "manifest.json").exists() for p in partial)
        if kind == "save:manifest":
            return any((ck / p / "manifest.json").exists() for p in partial)
        if kind == "save:pointer":
            latest = (ck / "latest").read_text().strip() if (ck / "latest").exists() else ""
            done = sorted(n for n in names if n.startswith("step_") and "." not in n)
            return bool(done) and bool(latest) and done[-1] > latest
    except OSError:
        return False
    return False


def hurt(p: subprocess.Popen, run: Path, kind: str, a: argparse.Namespace,
         rng: random.Random) -> dict:
    """Wait for the moment `kind` aims at and strike; returns what was done."""
    ck = run / "checkpoints"
    t_end = time.monotonic() + 300
    if kind in ("worker", "launcher"):
        # at a random point of the run: once a random number of rows is written
        target = rng.randrange(1, a.steps - 2)
        while written(run) < target:
            if p.poll() is not None or time.monotonic() > t_end:
                return {"note": "ended before the kill"}
            time.sleep(0.002)
        if kind == "launcher":
            p.kill()
            t0 = time.monotonic()
            p.wait()
            while session(p.pid) and time.monotonic() - t0 < 30:
                time.sleep(0.02)
            return {"at": written(run), "world_gone_s": time.monotonic() - t0}
    elif kind.startswith("save:"):
        first = rng.randrange(1, a.steps // a.save_every - 1) * a.save_every
        while not (ck / f"step_{first:06d}").exists() or not stage(ck, kind):
            if p.poll() is not None or time.monotonic() > t_end:
                return {"note": "the stage never showed"}
            time.sleep(0.0005)
    else:  # truncate / delete a rank file of the newest checkpoint, then a worker dies
        want = rng.randrange(2, a.steps // a.save_every - 1) * a.save_every
        name = f"step_{want:06d}"
        while not ((ck / "latest").exists() and (ck / "latest").read_text().strip() == name):
            if p.poll() is not None or time.monotonic() > t_end:
                return {"note": "never saw the checkpoint"}
            time.sleep(0.0005)
        f = ck / name / f"rank{rng.randrange(4):05d}.safetensors"
        if kind == "truncate":
            os.truncate(f, f.stat().st_size // 2)
        else:
            f.unlink()
        damaged = name
    ws = workers(p.pid)
    if not ws:
        return {"note": "no worker to kill"}
    victim = rng.choice(ws)
    os.kill(victim, signal.SIGKILL)
    done = {"at": written(run)}
    if kind in ("truncate", "delete"):
        done["damaged"] = damaged
    return done


def trial(a: argparse.Namespace, i: int, kind: str, preset: str, ref: Path,
          rng: random.Random) -> dict:
    run = a.out / f"t{i:02d}-{kind.replace(':', '-')}-{preset}"
    shutil.rmtree(run, ignore_errors=True)
    cmd = command(a, preset, run)
    t0 = time.monotonic()
    log = open(a.out / f"{run.name}.log", "w")  # noqa: SIM115
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    res = {"trial": i, "kind": kind, "preset": preset}
    try:
        res.update(hurt(p, run, kind, a, rng))
        if kind == "launcher":
            res["orphans_after_5s"] = len(session(p.pid))
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        rc = p.wait(timeout=600)
    finally:
        for pid in session(p.pid):
            os.kill(pid, signal.SIGKILL)
    log.close()
    text = (a.out / f"{run.name}.log").read_text()
    res["rc"] = rc
    res["recovery"] = text.count("restarting all")
    res["wall_s"] = round(time.monotonic() - t0, 1)
    time.sleep(0.5)
    res["orphans"] = len(session(p.pid))
    got, want = rows(run), rows(ref)
    res["steps_once_in_order"] = [r["step"] for r in got] == list(range(a.steps))
    res["metrics_equal"] = [[r.get(k) for k in KEYS] for r in got] == \
        [[r.get(k) for k in KEYS] for r in want]
    last = f"step_{a.steps:06d}"
    try:
        res["rank_files_equal"] = differences(run / "checkpoints" / last,
                                              ref / "checkpoints" / last) == []
    except Exception as e:  # noqa: BLE001 - reported in the table
        res["rank_files_equal"] = f"{type(e).__name__}: {e}"
    kept = sorted(x for x in (run / "checkpoints").glob("step_*") if "." not in x.name)
    expect = [f"step_{s:06d}" for s in range(a.steps, 0, -a.save_every)][:2][::-1]
    bad = []
    for ck in kept:
        try:
            verify_checkpoint(ck)
        except Exception:  # noqa: BLE001
            bad.append(ck.name)
    res["checkpoints_ok"] = [x.name for x in kept] == expect and not bad
    aside = sorted(x.name for x in (run / "checkpoints").glob("*.damaged*"))
    res["set_aside"] = aside
    res["skip_line"] = any("skipping damaged checkpoint" in ln for ln in text.splitlines())
    res["ok"] = (rc == 0 and res["orphans"] == 0 and res["steps_once_in_order"]
                 and res["metrics_equal"] and res["rank_files_equal"] is True
                 and res["checkpoints_ok"]
                 and (aside == [f"{res['damaged']}.damaged"] and res["skip_line"]
                      if "damaged" in res else not aside)
                 and res.get("world_gone_s", 0) < 5 and res.get("orphans_after_5s", 0) == 0)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--presets", default="zero3,zeropp-plus")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=43)
    ap.add_argument("--out", type=Path, default=Path("/tmp/zeropp-soak"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    presets = a.presets.split(",")
    refs = {}
    for preset in presets:
        refs[preset] = a.out / f"reference-{preset}"
        shutil.rmtree(refs[preset], ignore_errors=True)
        subprocess.run(command(a, preset, refs[preset]), check=True, capture_output=True)
    results = []
    for i in range(a.trials):
        preset = presets[i % len(presets)]
        r = trial(a, i, KINDS[i % len(KINDS)], preset, refs[preset], rng)
        results.append(r)
        print(json.dumps(r), flush=True)
    (a.out / "soak.json").write_text(json.dumps(results, indent=1))
    print("\n| # | preset | kill | at row | restarts | world gone (s) | exit | steps once, in order "
          "| losses = | rank files = | checkpoints ok | set aside | orphans | pass |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        gone = f"{r['world_gone_s']:.2f}" if "world_gone_s" in r else ""
        print(f"| {r['trial']} | {r['preset']} | {r['kind']} | {r.get('at', r.get('note'))} | "
              f"{r['recovery']} | {gone} | {r['rc']} | {r['steps_once_in_order']} | "
              f"{r['metrics_equal']} | {r['rank_files_equal']} | {r['checkpoints_ok']} | "
              f"{', '.join(r['set_aside']) or '-'} | {r['orphans']} | "
              f"{'yes' if r['ok'] else 'NO'} |")
    n_ok = sum(r["ok"] for r in results)
    print(f"\n{n_ok} of {len(results)} trials passed")
    return 0 if n_ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
