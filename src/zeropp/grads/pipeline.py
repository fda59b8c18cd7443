"""The reduce pipeline: gradient reduction off the backward's critical path.

When backward finishes a unit, its leaf hook hands the unit's flat gradient here and returns at
once; backward goes on to the next unit while the reduction runs on two communication threads
(DeepSpeed and FSDP2 run it on a side stream). Stage 1 does the plain ring reduce-scatter, or qgZ's
intra-node hop and the quantization of its inter-node hop; stage 2 only qgZ's inter-node all-to-all
and sum. So while unit k's bytes hold the slow link, unit k+1 is quantized and reduced
inside the node (benchmarks/probes/timeline.py: one thread doing both kept the link idle half the
time). The end of backward waits for every reduction (an autograd callback, as FSDP2's
post-backward), so whatever reads gradients afterwards (`clip_grad_norm_`, the optimizer, the next
micro-batch's accumulation, a checkpoint) sees them complete.

[Note: reductions on their own process groups]
The main thread issues gathers (and qWD's deltas) while the stage threads issue reductions. Two
threads cannot share a process group: the order in which their collectives reach a group would
differ between ranks, and a collective matched against a different one on another rank hangs or
corrupts. The reductions therefore run on duplicates of the world, intra-node and inter-node groups,
made once per layout (topology.reduce_groups). Each group is used by one thread only (stage 1: world
and intra-node; stage 2: inter-node), and on each every rank issues the same collectives in the same
order: gathers in unit-use order from the main thread, reductions in gradient-ready order from the
stage threads, all fixed by the model's structure.

[Note: exactness]
A unit's reduction is the same two functions whether they run here or inline (`async_reduce=False`):
the same quantization, the same sums in the same order, the same accumulation into the shard's
`.grad`; units touch disjoint gradients, so the interleaving cannot change a bit. Error-feedback
state is per FlatParam, and a unit's two stages run one after the other. The accumulation (`apply`)
runs on the main thread when it collects the job (at a later hand-over, at the end of backward): a
backward that raised leaves no reduction to land in `.grad` after the loop's `zero_grad()`; the next
root forward collects them without applying (`drain(keep=False)`).

[Note: CUDA]
On CUDA each reduction runs on a side stream that first waits for an event recorded on the compute
stream at hand-over, and records its own event when done; `drain()` makes the compute stream wait
for it. The side stream's work is ordered after everything the compute stream did before the
hand-over (the previous optimizer step's reads of `.grad` included), which makes reusing the side
stream's memory safe. The gradient handed over is marked used by the side stream (`record_stream`).
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections import deque
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch

from ..collectives import Comm


class _Job:
    __slots__ = ("label", "first", "second", "apply", "state", "grad", "device", "ready", "done",
                 "done_event", "error", "consumed")

    def __init__(self, label: str, first: Callable[[Comm], Any], second: Callable[[Comm, Any], Any],
                 grad: torch.Tensor, apply: Optional[Callable[[Any], None]]) -> None:
        self.label, self.first, self.second, self.grad = label, first, second, grad
        self.apply = apply
        self.device = grad.device
        self.state: Any = None   # what stage 1 hands to stage 2
        self.ready = None        # CUDA: the compute stream's event at hand-over
        self.done_event = None   # CUDA: the side stream's event when reduced
        self.done = threading.Event()
        self.consumed = threading.Event()  # stage 1 has run: the full gradient is let go
        self.error: Optional[BaseException] = None


class ReducePipeline:
    """Runs unit reductions in hand-over order, in two stages on two threads (the notes), at
    most `depth` of them holding their unit's full gradient (not yet through stage 1); inline,
    in the hook, if `asynchronous` is False."""

    def __init__(self, comm: Comm, *, depth: int, asynchronous: bool) -> None:
        self.comm, self.depth, self.asynchronous = comm, depth, asynchronous
        # Stage 2's own Comm: same groups and stats, its own `unit` for errors.
        self.comm2 = Comm(comm.topo, comm.stats, timeout=comm.timeout, groups=comm.groups)
        self.inflight: deque[_Job] = deque()
        self._failed = threading.Event()   # skip queued work after a failure
        self._stream = None

    def submit(self, label: str, grad: torch.Tensor, first: Callable[[Comm], Any],
               second: Callable[[Comm, Any], Any], apply: Optional[Callable] = None) -> None:
        """Reduce `grad`: `apply(second(comm, first(comm)))`, `apply` on this thread (the
        exactness note); returns once handed over (or done, inline)."""
        job = _Job(label, first, second, grad, apply)
        if not self.asynchronous:
            self._run_first(job)
            self._run_second(job)
            self._raise(job)
            return
        # Bounded memory: at most `depth` full gradients wait for stage 1. A job past
        # stage 1 holds only its inter-node piece (qgZ: 1/node_size of the unit, INT4),
        # so the slow link's stage 2 may queue behind without holding backward up.
        while self.inflight and self.inflight[0].done.is_set():
            self._finish(self.inflight.popleft())  # raise a failure as early as seen
        while True:  # one snapshot per check: stage 1 may finish a job meanwhile
            waiting = [j for j in self.inflight if not j.consumed.is_set()]
            if len(waiting) < self.depth:
                break
            waiting[0].consumed.wait()
        if grad.is_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=grad.device)
            job.ready = torch.cuda.current_stream(grad.device).record_event()
            grad.record_stream(self._stream)
        self.inflight.append(job)
        _worker(self.comm.groups, 1).put((self, job))

    def drain(self, keep: bool = True) -> None:
        """Wait for every reduction handed over (applied if `keep`); raise the first failure."""
        first: Optional[BaseException] = None
        while self.inflight:
            try:
                self._finish(self.inflight.popleft(), keep)
            except BaseException as e:  # keep draining: leave nothing in flight
                first = first or e
        self._failed.clear()
        if first is not None:
            raise first

    # ---- internals -------------------------------------------------------------
    def _finish(self, job: _Job, keep: bool = True) -> None:
        job.done.wait()
        if job.done_event is not None:
            torch.cuda.current_stream(job.device).wait_event(job.done_event)
            if isinstance(job.state, torch.Tensor):  # (made on the side stream, used here)
                job.state.record_stream(torch.cuda.current_stream(job.device))
        self._raise(job, keep)

    @staticmethod
    def _raise(job: _Job, keep: bool = True) -> None:
        apply, result = job.apply, job.state
        job.grad = job.first = job.second = job.state = job.apply = None
        if job.error is not None:
            err, job.error = job.error, None
            raise err
        if keep and apply is not None:
            apply(result)

    def _stage(self, job: _Job, comm: Comm, fn: Callable[[], None]) -> bool:
        """Run one stage of `job`; False (and the job done) if it failed or was
        skipped after an earlier failure (whose error, first in line, is raised)."""
        if not self._failed.is_set():
            try:
                comm.unit = job.label
                with torch.cuda.stream(self._stream) if job.ready is not None else nullcontext():
                    fn()
                return True
            except BaseException as e:
                job.error = e
                if self.asynchronous:
                    self._failed.set()
        job.done.set()
        return False

    def _run_first(self, job: _Job) -> None:
        def first() -> None:
            if job.ready is not None:
                self._stream.wait_event(job.ready)
            job.state = job.first(self.comm)
            # Stage 1 consumed the unit's full gradient: let it go now, not when the
            # main thread next looks at the job (it held up to `depth` of them, and
            # the largest unit's, through backward).
            job.first = job.grad = None
        ok = self._stage(job, self.comm, first)
        job.consumed.set()
        if ok and self.asynchronous:
            _worker(self.comm.groups, 2).put((self, job))

    def _run_second(self, job: _Job) -> None:
        if job.done.is_set():
            return  # stage 1 failed (inline path)
        def second() -> None:
            job.state = job.second(self.comm2, job.state)
            if job.ready is not None:
                job.done_event = self._stream.record_event()
        if self._stage(job, self.comm2, second):
            job.done.set()


# One communication thread per stage per set of reduce groups, shared by every model on them:
# a group must see its collectives from one thread, in one order (the groups' note).
_WORKERS: dict[tuple, tuple] = {}
_WORKERS_LOCK = threading.Lock()


def _worker(groups: dict, stage: int) -> queue.SimpleQueue:
    key = (id(groups), stage)
    with _WORKERS_LOCK:
        entry = _WORKERS.get(key)
        if entry is None or not entry[1].is_alive():
            q: queue.SimpleQueue = queue.SimpleQueue()
            t = threading.Thread(target=_loop, args=(q, stage), daemon=True,
                                 name=f"zeropp-reduce{stage}")
            t.start()
            entry = _WORKERS[key] = (q, t, groups)  # holds groups: id stays unique
        return entry[0]


def _loop(q: queue.SimpleQueue, stage: int) -> None:
    for pipeline, job in iter(q.get, None):  # until _stop_workers' None
        (pipeline._run_first if stage == 1 else pipeline._run_second)(job)


@atexit.register
def _stop_workers() -> None:
    """At exit, stop the communication threads and wait for them (and drop their process groups)
    before the interpreter tears itself down: a daemon thread cut off inside torch's C++ can abort
    the process ("terminate called without an active exception") after the program has finished."""
    with _WORKERS_LOCK:
        entries = list(_WORKERS.values())
        _WORKERS.clear()
    for q, _, _ in entries:
        q.put(None)
    for _, t, _ in entries:
        t.join(timeout=10)
