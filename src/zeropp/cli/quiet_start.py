"""Ctrl-C or SIGTERM while `zeropp ...` or `python -m zeropp ...` still imports torch (its
first 2-3 s here): one line and status 130 / 143, not the interpreter's KeyboardInterrupt
traceback through importlib (or a silent -15). zeropp/__init__.py imports this first,
before torch; it acts only when the process is zeropp's own command (a program that
imports zeropp keeps its handlers), and main() in main.py sets its own before it runs
the command."""

import os
import signal
import sys

# The interpreter's own arguments: a worker that multiprocessing's "spawn" starts copies
# its parent's sys.argv (the console script's path too) but never runs main().
_ARGV = getattr(sys, "orig_argv", [])


def _stopped(signum: int, frame: object) -> None:
    # Nothing to undo yet: no worker, file or lock exists before main() runs.
    cmd = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1].isalpha() else ""  # (not --help)
    how = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
    sys.stderr.write(f"zeropp{' ' + cmd if cmd else ''}: {how} while starting\n")
    os._exit(128 + signum)


def _ours() -> bool:
    if len(_ARGV) > 1 and os.path.basename(_ARGV[1]) == "zeropp":  # the console script
        return True
    # "-m" while Python imports the package of `-m NAME` (its argv[0] before NAME runs),
    # and NAME zeropp itself, not zeropp.train (torchrun's) or a "-m" a script was given
    return (sys.argv[:1] == ["-m"] and "-m" in _ARGV[:-1]
            and _ARGV[_ARGV.index("-m") + 1] == "zeropp")


if _ours():  # (also where the parent left them ignored or blocked, as main() does)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.signal(signal.SIGINT, _stopped)
    signal.signal(signal.SIGTERM, _stopped)
