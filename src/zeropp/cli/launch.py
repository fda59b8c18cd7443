"""Start W local gloo workers running one function; return their results.

Used by the tests (a world of 2-6 ranks on this machine) and by `zeropp train`
on one machine, so neither needs torchrun. Each worker gets the environment
torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE =
node_size), so one machine emulates N nodes of D ranks with node-major ranks.

Failure is bounded: the first worker that raises has its traceback re-raised
here at once and the others are killed (they would otherwise wait in a
collective until gloo's timeout); a hang past `timeout` dumps every worker's
stack to stderr, kills them all and raises.

Restarts (`max_restarts`, as torchrun's): after a failure every worker is
stopped and the whole world started again in a new process group, with
TORCHELASTIC_RESTART_COUNT set as torchrun sets it; the worker function
resumes from its last checkpoint (zeropp's training loop does). An error the
worker marks with `no_restart` (a checkpoint that cannot be read) ends the run
at once: restarting would meet it again.

[Note: a world dies with its launcher]
Under the fork server the workers are the server's children, not the
launcher's, and nothing tied them to it: a SIGKILLed launcher left a world
training headless into its run directory (the server itself lives on too:
each worker holds the write end of the pipe whose EOF would stop it). So
each worker waits, in a daemon thread, on a pidfd of the launcher and
SIGKILLs itself when it exits, and the server first: it served that launcher
alone, and would otherwise exit only after its interpreter's shutdown with
torch loaded (seconds on a busy machine). The resource tracker exits when the
last holder of its pipe does. Under "fork" the launcher is the real parent, and PR_SET_PDEATHSIG
(set too) has the kernel kill the worker without needing its interpreter.
A server started by pytest lives on when a worker dies: the ties point from
the workers to the launcher, never back.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import glob
import multiprocessing as mp
import os
import pickle
import queue
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional


class WorkerError(RuntimeError):
    """A worker raised, died or hung; the message carries its traceback. `short`
    is the cause in one line (rank, signal or exception, step), `fatal` that the
    worker asked not to be restarted (`no_restart`)."""

    def __init__(self, message: str, short: str = "", fatal: bool = False) -> None:
        super().__init__(message)
        self.short = short or message.splitlines()[0].rstrip(":")
        self.fatal = fatal


def no_restart(error: BaseException) -> BaseException:
    """Mark an error raised in a worker as one a restart would meet again (a
    damaged checkpoint, settings that differ): spawn ends the run with it at
    once. Returns `error`, to be raised."""
    error.zeropp_no_restart = True  # type: ignore[attr-defined]
    return error


# Each worker's latest step, shared with the launcher (`at_step`): the restart
# line says where the world was when a rank died.
_progress: Optional[tuple[Any, int]] = None
_stacks: Any = None


def at_step(step: int) -> None:
    """Record that this worker is at `step` (no-op outside spawn's workers)."""
    if _progress is not None:
        _progress[0][_progress[1]] = step


class PreloadError(ImportError):
    """Under start="fork": a module to import before forking failed to import."""


def _die_with(launcher: int) -> None:
    """End this process when the launcher does (see the note at the top)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    try:
        fd: Optional[int] = os.pidfd_open(launcher)
    except ProcessLookupError:
        os._exit(1)  # gone already, before we could watch it
    except (AttributeError, OSError):
        fd = None  # no pidfds (not Linux >= 5.3): poll

    # Our parent, when it is the launcher's own fork server (not one a worker reuses).
    server = os.getppid() if _parent_of(os.getppid()) == launcher else None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])  # readable once the launcher has exited
        else:
            while pid_alive(launcher):
                time.sleep(0.5)
        if server is not None and os.getppid() == server:  # still ours: no pid reuse
            os.kill(server, signal.SIGKILL)  # it served the dead launcher alone
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, daemon=True, name="zeropp-launcher-watch").start()


def _parent_of(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (a zombie counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _summary(e: BaseException) -> tuple[str, bool]:
    """(`Type: first line of the message`, whether it is gloo's text)."""
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    gloo = "gloo" in first.lower() or "connection" in first.lower()
    return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__, gloo


def _worker(rank: int, world: int, node_size: int, init_file: str, fn: Callable,
            args: Sequence, q: Any, timeout: float, threads: int, backend: str,
            restart: int, launcher: int, progress: Any) -> None:
    global _progress
    _die_with(launcher)
    _progress = (progress, rank)
    # Ctrl-C reaches the whole process group; the parent alone handles it (and
    # kills us), so workers do not each print a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (forked: not the launcher's handler)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % node_size),
                      LOCAL_WORLD_SIZE=str(node_size), GROUP_RANK=str(rank // node_size),
                      TORCHELASTIC_RESTART_COUNT=str(restart))
    global _stacks  # kept open: the launcher's SIGUSR1 at a timeout writes this rank's stacks
    _stacks = open(os.path.join(os.path.dirname(init_file), f"stacks{rank}"), "w")
    faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout))
        # Not before every rank is through gloo's connection set-up: a rank whose
        # init returned may close its sockets (a function that destroys the group at
        # once, or does no collective) while a slower peer still reads its handshake
        # on them ("Connection closed by peer" in connectFullMesh, seen in CI with two
        # test worlds sharing the cores). NCCL connects lazily, at the first collective.
        if backend == "gloo":
            dist.barrier()
        # Plain pickle: torch's queue pickler would pass tensors as shared-memory
        # handles, which die with this process.
        q.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException as e:
        what, gloo = _summary(e)
        text = f"{e}\n" if getattr(e, "zeropp_one_line", False) else traceback.format_exc()
        q.put((rank, False, (text, what, gloo, bool(getattr(e, "zeropp_no_restart", False)))))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, node_size: Optional[int] = None,
          args: Sequence = (), timeout: Optional[float] = 180.0, threads: int = 1,
          backend: str = "gloo", pg_timeout: Optional[float] = None,
          max_restarts: int = 0, preload: Sequence[str] = (),
          start: str = "forkserver", verbose: bool = False,
          log: Optional[str] = None) -> list[Any]:
    """Run `fn(*args)` on `world_size` fresh processes; return results by rank.

    `fn` must be importable by name (a module-level function). Raises
    WorkerError naming the failing rank, with its traceback, on any failure
    (after `max_restarts` restarts of the whole world, each announced on
    stderr). `timeout`: seconds per attempt (None: no limit); `pg_timeout`: the
    process group's collective timeout (default: `timeout`, or 30 minutes).
    `preload`: more modules to import once, before any worker forks (each worker
    then starts with them imported). `start`: "forkserver" (the default: workers
    fork from a fresh server process, safe whatever the caller has run, such as
    pytest) or "fork" (from the caller itself, which then imports the preloads:
    for a caller that has run no tensor op and owns no threads the workers use,
    like `zeropp launch`, it saves the server's own import of torch).
    Each restart is announced in one line (the cause: rank, signal or exception,
    step; the failing rank's last message line, such as gloo's, only with
    `verbose`); `log`: a file each failure's full text (tracebacks) is appended to.
    """
    node_size = world_size if node_size is None else node_size
    if node_size < 1 or world_size % node_size:
        raise ValueError(f"spawn: node_size={node_size} must divide world_size={world_size}")
    if max_restarts < 0:
        raise ValueError(f"spawn: max_restarts={max_restarts} must be >= 0")
    if start not in ("forkserver", "fork"):
        raise ValueError(f"spawn: start={start!r} must be 'forkserver' or 'fork'")
    # Workers fork from a process that imported torch once: fast starts. torch._dynamo
    # too: every optimizer's constructor imports it (2 s of CPU per process, most of a
    # small test world's start-up), and zeropp itself. Last, _frozen_heap: the
    # workers' garbage collector never walks (so never copies) that imported heap.
    modules = ["torch", "torch.distributed", "torch._dynamo", "zeropp", *preload,
               "zeropp.cli._frozen_heap"]
    if start == "fork":
        import importlib
        sigint = signal.getsignal(signal.SIGINT)
        for m in modules:
            try:
                importlib.import_module(m)
            except (Exception, SystemExit) as e:
                raise PreloadError(f"preload {m!r} failed to import: "
                                   f"{type(e).__name__}: {e}") from e
        # Here, not in a fork server: a preload that set its own SIGINT handler
        # would change how Ctrl-C reaches the wait for the workers.
        if sigint is not None:  # None: not set from Python, nothing to restore
            signal.signal(signal.SIGINT, sigint)
    for attempt in range(max_restarts + 1):
        try:
            return _spawn_once(fn, world_size, node_size, args, timeout, threads, backend,
                               pg_timeout or timeout or 1800.0, attempt, modules, start)
        except BaseException as e:
            if not isinstance(e, WorkerError):
                if not isinstance(e, Exception) and start == "forkserver":  # a stop
                    _stop_forkserver()
                raise
            if log:
                with open(log, "a") as f:
                    f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} attempt {attempt}: "
                            f"{e.short}\n{e}\n\n")
            if attempt == max_restarts or e.fatal:
                raise
            why = e.short
            if verbose:
                lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
                why += f" ({lines[-1]})" if len(lines) > 1 else ""
            print(f"zeropp: {why}; restarting all {world_size} workers "
                  f"(restart {attempt + 1} of {max_restarts})", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


@contextlib.contextmanager
def children_ignore_sigint() -> Iterator[None]:
    """Processes started inside start with SIGINT ignored, which an exec keeps: a Ctrl-C
    (the whole process group's) is then the launcher's alone, which stops them, and they
    print no KeyboardInterrupt traceback. Blocked here meanwhile, so that one arriving
    then waits for the handler's return (ignored alone, it was lost). Blocked in this
    thread only: one another thread takes in these milliseconds is still lost. Not the
    teardown's record-and-replay (bench/cluster.py): an exec resets a caught signal to
    its default, so the children would not ignore it."""
    main = threading.current_thread() is threading.main_thread()  # (signal.signal's rule)
    if not main or signal.getsignal(signal.SIGINT) is None:  # (a handler not Python's)
        yield
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _start_forkserver() -> None:
    """The fork server started with SIGINT ignored; the workers it forks keep that until
    `_worker` sets theirs: a Ctrl-C while it imports the preloads or forks a worker is the
    launcher's alone (they printed KeyboardInterrupt tracebacks: 6 of 8 Ctrl-Cs in `zeropp
    train`'s first 8 s)."""
    from multiprocessing import forkserver
    with children_ignore_sigint():
        forkserver.ensure_running()


def _stop_forkserver() -> None:
    """Kill the fork server at a stop (Ctrl-C, SIGTERM): while it imports the preloads it
    neither sees us go (it held our stdout open for seconds) nor forgets a request of
    `p.start()` (it forked it after we had gone, and the worker, finding our queue gone,
    printed a traceback)."""
    from multiprocessing import forkserver
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _spawn_once(fn: Callable, world_size: int, node_size: int, args: Sequence,
                timeout: Optional[float], threads: int, backend: str, pg_timeout: float,
                restart: int, modules: list, start: str) -> list[Any]:
    ctx = mp.get_context(start)
    if start == "forkserver":  # (a server already running keeps its first preloads)
        ctx.set_forkserver_preload(modules)
        _start_forkserver()
    q = ctx.Queue()
    progress = ctx.RawArray("q", [-1] * world_size)
    with tempfile.TemporaryDirectory(prefix="zeropp-") as tmp:
        init_file = os.path.join(tmp, "store")
        # Not daemonic: a daemonic process may not start children, and a script's
        # DataLoader(num_workers > 0) must (it died in an AssertionError). _stop and
        # _die_with end the workers; multiprocessing's exit need not.
        procs = [ctx.Process(target=_worker, daemon=False,
                             args=(r, world_size, node_size, init_file, fn, tuple(args), q,
                                   pg_timeout, threads, backend, restart, os.getpid(),
                                   progress))
                 for r in range(world_size)]
        ok, started = False, []
        try:  # (a stop while they start, Ctrl-C or SIGTERM, kills those started so far)
            with warnings.catch_warnings():
                # Python >= 3.12 warns at a fork from a process with threads (under
                # start="fork", the rendezvous stores' server threads, which the workers
                # never use); under -W error that warning would replace a clean start.
                warnings.simplefilter("ignore", DeprecationWarning)
                for p in procs:
                    p.start()
                    started.append(p)
            results = _collect(procs, q, timeout, progress, tmp)
            ok = True
            return results
        finally:
            _stop(started, grace=10.0 if ok else 0.0)


def _collect(procs: list, q: Any, timeout: Optional[float], progress: Any,
             tmp: str) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout if timeout is not None else float("inf")
    while len(results) < len(procs):
        try:
            rank, ok, payload = q.get(timeout=0.1)
        except queue.Empty:
            died = _died(procs, results, progress)
            if died:
                raise WorkerError(died) from None
            if time.monotonic() > deadline:
                missing = [r for r in range(len(procs)) if r not in results]
                for r in missing:  # each rank's stacks on stderr before killing, in turn
                    if procs[r].is_alive():  # (each printing its own, they interleaved)
                        os.kill(procs[r].pid, signal.SIGUSR1)
                time.sleep(0.5)
                for r in missing:
                    with contextlib.suppress(OSError):
                        with open(os.path.join(tmp, f"stacks{r}")) as f:
                            print(f"--- rank {r}'s stacks:\n{f.read()}", file=sys.stderr,
                                  end="", flush=True)
                raise WorkerError(f"ranks {missing} did not finish within {timeout:.0f}s "
                                  "(hang?); their stacks are on stderr above") from None
            continue
        if not ok:
            text, what, gloo, fatal = payload
            # A peer's death shows up here first as a connection reset: name the cause.
            end = time.monotonic() + 1.0
            while not (died := _died(procs, results, progress)) and time.monotonic() < end:
                time.sleep(0.05)
            if died:
                raise WorkerError(f"{died}; then rank {rank} raised:\n{text}", died, fatal)
            short = f"rank {rank} raised {what.split(':')[0] if gloo else what}"
            raise WorkerError(f"rank {rank} raised:\n{text}", short + _step(progress, rank),
                              fatal)
        results[rank] = pickle.loads(payload)
    return [results[r] for r in range(len(procs))]


def _step(progress: Any, rank: int) -> str:
    return f" at step {progress[rank]}" if progress is not None and progress[rank] >= 0 else ""


def _died(procs: list, results: dict, progress: Any = None) -> str:
    """'rank r died (...) [at step s]' for the first worker gone without a
    result, else ''."""
    for r, p in enumerate(procs):
        if r not in results and p.exitcode not in (None, 0):
            how = (f"killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0
                   else f"exit code {p.exitcode}")
            return f"rank {r} died ({how}){_step(progress, r)}"
    return ""


def _stop(procs: list, grace: float) -> None:
    _wait(procs, grace)
    for p in procs:
        if p.exitcode is None:
            for pid in _descendants(p.pid):  # a script's DataLoader workers: orphaned,
                try:  # they lived on until their watchdog noticed (5 s); torchrun's too
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.kill()
    _wait(procs, 5.0)


def _descendants(pid: int) -> list[int]:
    """The children of `pid` and theirs (Linux's /proc; elsewhere none)."""
    found: list[int] = []
    for f in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            kids = [int(k) for k in Path(f).read_text().split()]
        except OSError:
            continue
        for k in kids:
            found += [k, *_descendants(k)]
    return found


def _wait(procs: list, seconds: float) -> None:
    """Until every worker has exited (reaped) or `seconds` passed. It polls exitcode
    (waitpid), not join: under "fork" join waits for EOF on a pipe that a killed
    worker's own children (DataLoader workers) still hold, 5 s a rank on Ctrl-C."""
    end = time.monotonic() + seconds
    while any(p.exitcode is None for p in procs) and time.monotonic() < end:
        time.sleep(0.01)


def host_store(timeout: float = 1800.0) -> Any:
    """A rendezvous store hosted by this process, as torchrun's agent hosts one: on a
    port the OS picks and this process holds from then on, so concurrent launches
    cannot race for it. Ranks join it as clients (MASTER_PORT = `.port`,
    TORCHELASTIC_USE_AGENT_STORE=True); it lives as long as the returned object."""
    from torch.distributed import TCPStore
    return TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout),
                    wait_for_workers=False)


def run_script(path: str, argv: Sequence[str], ports: Sequence[int]) -> None:
    """A worker of `zeropp launch`: run the script as `__main__` with `argv` in the
    environment torchrun gives it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT; no process group yet: the script makes it, with
    `init_process_group()` or `zeropp.init_distributed()`). The store at MASTER_PORT
    is the launcher's, one per attempt (`ports[restart]`); TORCHELASTIC_USE_AGENT_STORE
    tells torch's env:// rendezvous that every rank is its client, as under torchrun.
    `sys.exit(0)` is success. Under `--as-deepspeed` the worker forked from a server
    that imported zeropp.deepspeed.installed: `import deepspeed` already answers."""
    import runpy

    import torch.distributed as dist
    if dist.is_initialized():  # spawn's own group: the script initializes as under torchrun
        dist.destroy_process_group()  # (every rank is through its set-up: _worker's barrier)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[restart]),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            error = RuntimeError(f"{path} exited with status {e.code}")
            error.zeropp_one_line = True  # the script said why (sys.exit): no traceback of ours
            raise error from None
