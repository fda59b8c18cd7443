"""torchft's process group, its all-reduce replaced by zeropp's (allreduce.py).

torchft's Manager owns one process group across the replicas: it reconfigures it
when the quorum changes and calls its `allreduce` for everything it averages
(DDP's buckets, the HSDP replicate group, LocalSGD's and DiLoCo's syncs). The
wrapper keeps torchft's group for membership and transport and changes only what
goes on the wire; a failed collective raises inside `allreduce`, which the
Manager reports as its own (the step is not committed).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torchft.process_group import ProcessGroup, ProcessGroupWrapper

from .allreduce import CompressedAllReduce


class _Done(dist._Work):
    """A collective already completed in `allreduce` (its future holds the tensors)."""

    def __init__(self, result: object) -> None:
        super().__init__()
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class CompressedGroup(ProcessGroupWrapper):
    """`pg` (a torchft process group) whose all-reduces are zeropp's (`codec`)."""

    def __init__(self, pg: ProcessGroup, codec: str, *, block_size: int = 2048,
                 error_feedback: Optional[bool] = None) -> None:
        self._zeropp = CompressedAllReduce(codec, block_size=block_size,
                                           error_feedback=error_feedback)
        super().__init__(pg=pg)
        self._inner = pg

    # ---- membership: torchft's, with the residuals following it -----------------------
    def get_reconfigure_handle(self) -> str:
        # the Manager asks for it once per quorum, i.e. at the start of every step
        self._zeropp.new_round()
        return self._inner.get_reconfigure_handle()

    def follow_fragments(self, manager: Any, fragments: int) -> None:
        """Streaming DiLoCo over `fragments` fragments: each sync's residuals are those of
        the fragment torchft syncs (its own choice: the manager's step modulo their
        number), not the previous sync's (allreduce.py's note)."""
        if not (isinstance(fragments, int) and fragments >= 1):
            raise ValueError(f"zeropp.ft: fragments={fragments!r} is invalid; allowed: an int >= 1")
        self._zeropp.round_key = lambda: manager.current_step() % fragments

    def reconfigure(self, opts: Any) -> dist._Work:
        self._zeropp.reset()
        return super().reconfigure(opts)

    def abort(self, errored: bool = True) -> None:
        # ProcessGroupWrapper would forget the wrapped group; torchft's groups rebuild
        # themselves at the next reconfigure, so keep it
        self._inner.abort()

    def shutdown(self) -> None:
        self._inner.shutdown()

    def errored(self) -> Optional[Exception]:
        return self._inner.errored()

    def set_timeout(self, timeout: timedelta) -> None:
        # the wrapped group builds the gloo/NCCL backend (with its timeout) at reconfigure;
        # ProcessGroupWrapper's would set ours, which nothing reads
        self._inner.set_timeout(timeout)

    @property
    def parent(self) -> Any:
        return self._inner

    # ---- the all-reduce ---------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist._Work:
        op = getattr(opts, "reduceOp", opts)
        with self._run_context():
            for t in tensors:
                self._zeropp.all_reduce_(self._inner, t, op, self._rank, self.size())
        return _Done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> dist._Work:
        return self.allreduce(tensors, opts)

    def getBackendName(self) -> str:
        return f"zeropp-{self._zeropp.codec}-{self._inner.getBackendName()}"

    def __repr__(self) -> str:
        return f"CompressedGroup({self._zeropp.codec}, pg={self._inner!r})"
