"""Start W local gloo workers running one function; return their results.

Used by the tests (a world of 2-6 ranks on this machine) and by `zeropp train`
on one machine, so neither needs torchrun. Each worker gets the environment
torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE =
node_size), so one machine emulates N nodes of D ranks with node-major ranks.

Failure is bounded: the first worker that raises has its traceback re-raised
here at once and the others are killed (they would otherwise wait in a
collective until gloo's timeout); a hang past `timeout` dumps every worker's
stack to stderr, kills them all and raises.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Callable, Optional


class WorkerError(RuntimeError):
    """A worker raised, died or hung; the message carries its traceback."""


def _worker(rank: int, world: int, node_size: int, init_file: str, fn: Callable,
            args: Sequence, q: Any, timeout: float, threads: int, backend: str) -> None:
    # Ctrl-C reaches the whole process group; the parent alone handles it (and
    # kills us), so workers do not each print a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % node_size),
                      LOCAL_WORLD_SIZE=str(node_size), GROUP_RANK=str(rank // node_size))
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout))
        # Plain pickle: torch's queue pickler would pass tensors as shared-memory
        # handles, which die with this process.
        q.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, node_size: Optional[int] = None,
          args: Sequence = (), timeout: Optional[float] = 180.0, threads: int = 1,
          backend: str = "gloo", pg_timeout: Optional[float] = None) -> list[Any]:
    """Run `fn(*args)` on `world_size` fresh processes; return results by rank.

    `fn` must be importable by name (a module-level function). Raises
    WorkerError naming the failing rank, with its traceback, on any failure.
    `timeout`: seconds for the whole run (None: no limit); `pg_timeout`: the
    process group's collective timeout (default: `timeout`, or 30 minutes).
    """
    pg_timeout = pg_timeout or timeout or 1800.0
    node_size = world_size if node_size is None else node_size
    if node_size < 1 or world_size % node_size:
        raise ValueError(f"spawn: node_size={node_size} must divide world_size={world_size}")
    ctx = mp.get_context("forkserver")
    # Workers fork from a server that imported torch once: fast, fork-safe starts.
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="zeropp-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, world_size, node_size, init_file, fn, tuple(args), q,
                                   pg_timeout, threads, backend))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        ok = False
        try:
            results = _collect(procs, q, timeout)
            ok = True
            return results
        finally:
            _stop(procs, grace=10.0 if ok else 0.0)


def _collect(procs: list, q: Any, timeout: Optional[float]) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout if timeout is not None else float("inf")
    while len(results) < len(procs):
        try:
            rank, ok, payload = q.get(timeout=0.1)
        except queue.Empty:
            for r, p in enumerate(procs):
                if r not in results and p.exitcode not in (None, 0):
                    raise WorkerError(f"rank {r} died with exit code {p.exitcode} "
                                      "(killed or crashed) before returning a result") from None
            if time.monotonic() > deadline:
                missing = [r for r in range(len(procs)) if r not in results]
                for r in missing:  # ask for stacks on stderr before killing
                    if procs[r].is_alive():
                        os.kill(procs[r].pid, signal.SIGUSR1)
                time.sleep(0.5)
                raise WorkerError(f"ranks {missing} did not finish within {timeout:.0f}s "
                                  "(hang?); their stacks are on stderr above") from None
            continue
        if not ok:
            raise WorkerError(f"rank {rank} raised:\n{payload}")
        results[rank] = pickle.loads(payload)
    return [results[r] for r in range(len(procs))]


def _stop(procs: list, grace: float) -> None:
    end = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
