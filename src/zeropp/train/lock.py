"""A run directory belongs to one world at a time: RUN/.lock.

The launcher of `zeropp train` holds an exclusive `flock` on RUN/.lock for as
long as it runs and writes its host and pid into the file; a second launcher
on the same directory is refused in one line naming them. The kernel drops the
lock when its holder dies, however it dies, so a lock left by a killed
launcher is stale by construction and the next one takes it over (its workers
die with it: cli/launch.py). Where the filesystem has no flock, the pid inside is
checked instead (alive on this host: refused). The file itself stays: deleting
it while another launcher opens it would let two of them lock two files.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

from ..cli.launch import pid_alive

LOCK = ".lock"


class RunLocked(RuntimeError):
    """Another live launcher owns the run directory."""


def _owner(text: str) -> Optional[dict]:
    try:
        owner = json.loads(text)
    except ValueError:
        return None
    return owner if isinstance(owner, dict) else None


def _describe(owner: Optional[dict]) -> str:
    if not owner:
        return "another zeropp train"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("since", 0)))
    return f"zeropp train (pid {owner.get('pid')} on host {owner.get('host')}, since {since})"


class RunLock:
    """`with RunLock(run_dir):` owns RUN/.lock, or raises RunLocked at entry."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK
        self.fd: Optional[int] = None

    def __enter__(self) -> RunLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            held = e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
            owner = _owner(os.pread(fd, 4096, 0).decode(errors="replace"))
            if not held:  # no flock here: the pid inside decides
                held = bool(owner and owner.get("host") == socket.gethostname()
                            and owner.get("pid") != os.getpid() and pid_alive(owner["pid"]))
            if held:
                os.close(fd)
                raise RunLocked(f"{self.path.parent} is in use by {_describe(owner)}; wait "
                                "for it to end or stop it (one world per run directory)"
                                ) from None
        me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                         "since": time.time()}) + "\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None
