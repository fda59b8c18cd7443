"""Ctrl-C while `zeropp ...` or `python -m zeropp ...` still imports torch (its first
2-3 s here): one line and status 130, not the interpreter's KeyboardInterrupt traceback
through importlib. zeropp/__init__.py imports this first, before torch; it acts only
when the command line is zeropp's own (a program that imports zeropp keeps its Ctrl-C),
and main() in main.py puts Python's handler back before it runs the command."""

import os
import signal
import sys

_ARGV = getattr(sys, "orig_argv", sys.argv)


def _interrupted(signum: int, frame: object) -> None:
    # Nothing to undo yet: no worker, file or lock exists before main() runs.
    cmd = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1].isalpha() else ""
    sys.stderr.write(f"zeropp{' ' + cmd if cmd else ''}: interrupted while starting\n")
    os._exit(130)


def _ours() -> bool:
    first = sys.argv[0] if sys.argv else ""
    if os.path.basename(first) == "zeropp":  # the console script
        return True
    # "-m" while Python imports the package of `-m NAME` (its argv[0] before NAME runs),
    # and NAME zeropp itself, not zeropp.train (torchrun's) or a "-m" a script was given
    return first == "-m" and "-m" in _ARGV[:-1] and _ARGV[_ARGV.index("-m") + 1] == "zeropp"


if _ours():  # (also where the parent left SIGINT ignored or blocked, as main() does)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, _interrupted)
