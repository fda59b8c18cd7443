"""The examples in examples/hf/ run as a user runs them (torchrun, `zeropp launch`), and
what the tests read back from them: shared by tests/deepspeed/test_hf_deepspeed.py and
tests/deepspeed/test_hf_trl.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cases import failed_run

# a test module importing this one is skipped where the HF stack is missing
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[1]
HF = ROOT / "examples" / "hf"
STEPS = 8


def _torchrun(script: str, world: int, out: Path, *args: str) -> str:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return _run([torchrun, "--standalone", "--nproc-per-node", str(world)], script, out, args)


def _straight(script: str, world: int, out: Path, *args: str) -> str:
    """The straight run: torchrun at W=2, so each test checks at W=2 that torchrun and
    `zeropp launch` (the resumed run) give the same bits; `zeropp launch` at W=4,
    where torchrun's four fresh interpreters importing transformers and TRL
    (about 6 s of CPU each, on 2 cores) cost 6-9 s more per launch than the
    launcher's one preloading server (measured, the W=4 TRL SFT straight run,
    alternating: torchrun 21.3 and 18.5 s, `zeropp launch` 12.3 and 13.0 s)."""
    return (_torchrun if world == 2 else _zeropp_launch)(script, world, out, *args)


def _zeropp_launch(script: str, world: int, out: Path, *args: str) -> str:
    """The same job under `zeropp launch`, with torchrun's environment (every rank on
    one machine: LOCAL_WORLD_SIZE = world). Its workers fork from a server that has
    imported torch and, after `--as-deepspeed`'s install, the libraries the examples
    import (transformers, accelerate and TRL see zeropp as DeepSpeed when they decide;
    the examples' own install line is then a no-op), which makes a launch cheaper than
    torchrun's here; the resumed runs use it, so each test also checks that the two
    launchers give the same bits."""
    return _run([sys.executable, "-m", "zeropp", "launch", "--nproc", str(world),
                 "--node-size", str(world), "--timeout", "400",
                 "--as-deepspeed", "--preload", "torch.distributed.tensor,pandas,datasets,"
                 "psutil,transformers,accelerate,trl"],
                script, out, args)


def _run(launcher: list[str], script: str, out: Path, args: tuple) -> str:
    r = subprocess.run([*launcher, str(HF / script), "--out", str(out), "--node-size", "2",
                        *args], capture_output=True, text=True, timeout=420, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                            "PYTHONFAULTHANDLER": "1"})  # a crash shows its Python stacks
    assert r.returncode == 0, failed_run(r.stdout, r.stderr, 4000)
    return r.stdout


def _series(text: str, name: str) -> list[float]:
    return json.loads(re.findall(rf"^{name} (\[.*\])$", text, re.M)[-1])


def _reloads(final: Path, checkpoint: Path, tol: float = 0.1) -> None:
    """`from_pretrained(final)`: its weights are the consolidated last checkpoint's,
    bit for bit, and its logits on the probe those the trained sharded model wrote,
    within `tol` of the largest logit: with qwZ that forward ran on INT8-gathered
    weights (measured: 5.5% at the Trainer example's 8 steps); exact without it."""
    import transformers

    from zeropp.cli.export import consolidate
    model = transformers.AutoModelForCausalLM.from_pretrained(final).eval()
    sd, ck = model.state_dict(), consolidate(checkpoint)
    for k, v in ck.items():
        assert torch.equal(sd[k], v), k
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])).logits.reshape(-1)
    probe = torch.tensor(json.loads((final / "probe.json").read_text()))
    err = (logits - probe).abs().max().item()
    assert err <= tol * probe.abs().max().item(), err


def _global_step(ck: Path) -> Path:
    return next(p for p in ck.iterdir() if p.name.startswith("global_step"))
