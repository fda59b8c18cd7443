"""benchmarks/conformance/gpu_check.py, the script a GPU task runs first, in its CPU
mode so that it cannot rot: every check passes (zero3 equal to one process to 1e-5,
ranks bitwise equal, the reduce pipeline bitwise equal to the synchronous path, FSDP2
with zeropp's comms (zero3 equal to one process to 1e-5, the same probe loss on every rank),
quantization error within bounds, the compiled codecs' bytes equal the eager ones) and
the memory table is there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_cpu_mode_passes_every_check(tmp_path):
    out = tmp_path / "gc.json"
    script = ROOT / "benchmarks" / "conformance" / "gpu_check.py"
    r = subprocess.run([sys.executable, str(script), "--device",
                        "cpu", "--json", str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = json.loads(out.read_text())["rows"]
    names = [row["check"] for row in rows]
    assert names == ["train zero3", "train zeropp", "train zeropp-plus", "train zeropp-plus bf16",
                     "pipeline async == sync", "fsdp2 zero3", "fsdp2 zeropp-plus", "w1 (gloo)", "hf_load (gloo)",
                     "quant int8 eager", "quant int8 compiled",
                     "quant int4 eager", "quant int4 compiled",
                     "codecs int8 compiled == eager", "codecs int4 compiled == eager", "qwd"]
    assert all(row["ok"] for row in rows)
    assert "| zeropp-plus |" in r.stdout  # the memory table
