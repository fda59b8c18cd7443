"""torchft's own integration tests of DDP / LocalSGD / DiLoCo (shipped in its wheel),
with the Manager's group wrapped by `zeropp.ft.wrap(..., codec)` and, for the
comparison, unwrapped. Run from a scratch folder: torchft's `multiprocessing.py`
shadows the standard library's when run from inside the package.

    python benchmarks/conformance/torchft_tests.py [codec=int8] [--unwrapped]
Needs torchft (`pip install -e .[ft]`) and `parameterized`, `expecttest`.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = ["torchft.manager_integ_test", "torchft.local_sgd_integ_test"]


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    codec = args[0] if args else "int8"
    env = dict(os.environ, ZEROPP_FT_CODEC=codec,
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", *TESTS]
    if "--unwrapped" not in sys.argv:
        cmd[4:4] = ["-p", "torchft_wrap_plugin"]
    with tempfile.TemporaryDirectory() as scratch:
        return subprocess.call(cmd, cwd=scratch, env=env)


if __name__ == "__main__":
    sys.exit(main())
