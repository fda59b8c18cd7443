"""The same DeepSpeed script under real DeepSpeed and under zeropp: runs each
example of examples/deepspeed/ twice under torchrun (4 ranks), once as written
(`import zeropp as deepspeed`) and once with that line back to `import deepspeed`,
on the same config, and compares rank 0's printed losses, learning rates and
gradient norms step by step. Needs DeepSpeed (`DS_BUILD_OPS=0 pip install
'zeropp[bench]'`); its CPU accelerator has no FusedAdam, so the config gets
`torch_adam: true` (torch's AdamW on both sides) and loses the ZeRO++ keys
(DeepSpeed's qwZ/qgZ need CUDA kernels).

    python benchmarks/conformance/deepspeed_parity.py --steps 30 [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _report
from _report import report  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "deepspeed"
RUNS = [("cifar_cnn.py", "ds_config_cnn.json", "fp32"),
        ("transformer_lm.py", "ds_config_lm.json", "fp32"),
        ("transformer_lm.py", "ds_config_lm.json", "bf16")]
LINE = re.compile(r"^step (\d+) loss (\S+) lr (\S+)(?: grad_norm (\S+))?", re.M)


def _run(script: Path, cfg: Path, steps: int) -> list[tuple]:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    r = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "4", str(script),
                        "--deepspeed", "--deepspeed_config", str(cfg), "--steps", str(steps)],
                       capture_output=True, text=True, timeout=1800, cwd=ROOT,
                       env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    rows = [tuple(float(x) if x else None for x in m.groups()) for m in LINE.finditer(r.stdout)]
    if r.returncode or len(rows) != steps:
        raise SystemExit(f"{script.name} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    import deepspeed  # noqa: F401 - fail early, with pip's message, when it is missing
    lines = ["| script | precision | steps | max abs loss diff | max rel loss diff | lr equal "
             "every step | max rel grad-norm diff | final loss DeepSpeed / zeropp |",
             "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for script, config, prec in RUNS:
            cfg = json.loads((EXAMPLES / config).read_text())
            cfg["optimizer"]["params"]["torch_adam"] = True
            cfg["zero_optimization"] = {"stage": 3}
            cfg["bf16"] = {"enabled": prec == "bf16"}
            cfg_path = Path(tmp) / f"{script}-{prec}.json"
            cfg_path.write_text(json.dumps(cfg))
            ds_script = Path(tmp) / f"ds_{script}"
            ds_script.write_text((EXAMPLES / script).read_text().replace(
                "import zeropp as deepspeed  # was: import deepspeed", "import deepspeed"))
            print(f"{script} {prec}: DeepSpeed ...", end=" ", flush=True)
            ds = _run(ds_script, cfg_path, a.steps)
            print("zeropp ...", flush=True)
            zp = _run(EXAMPLES / script, cfg_path, a.steps)
            dl = [abs(x[1] - y[1]) for x, y in zip(ds, zp)]
            rl = [d / abs(x[1]) for d, x in zip(dl, ds)]
            lr_eq = all(x[2] == y[2] for x, y in zip(ds, zp))
            gn = [abs(x[3] - y[3]) / x[3] for x, y in zip(ds, zp) if x[3] is not None]
            lines.append(f"| {script} | {prec} | {a.steps} | {max(dl):.1e} | {max(rl):.1e} | "
                         f"{'yes' if lr_eq else 'no'} | {f'{max(gn):.1e}' if gn else 'n/a'} | "
                         f"{ds[-1][1]:.6f} / {zp[-1][1]:.6f} |")
    import deepspeed as d
    report([f"### Same script, DeepSpeed vs zeropp ({time.strftime('%Y-%m-%d')})", "",
            f"Command: `python benchmarks/conformance/deepspeed_parity.py {' '.join(sys.argv[1:])}`  ",
            f"examples/deepspeed/*.py under `torchrun --nproc-per-node 4`, once with `import "
            f"deepspeed` (DeepSpeed {d.__version__}, CPU accelerator, ZeRO-3) and once as "
            "written (`import zeropp as deepspeed`), same config (the example's, with "
            "`torch_adam: true` and no ZeRO++ keys: DeepSpeed's FusedAdam, qwZ and qgZ need "
            "CUDA). Rank 0's printed loss (its own micro-batch), learning rate (6 decimals) "
            "and global gradient norm (4 decimals), step by step.", "", *lines], a.write)


if __name__ == "__main__":
    main()
