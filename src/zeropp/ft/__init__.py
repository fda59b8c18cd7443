"""zeropp inside torchft: replicas across slow links that may fail.

torchft (PyTorch's fault-tolerance library) keeps replica groups training through
failures: a lighthouse forms a quorum each step, a failed collective means "this
step is not committed", a restarted replica heals from a live peer. Everything it
averages across replicas goes through its Manager's process group, so one line
puts zeropp's codecs on that wire:

    pg = zeropp.ft.wrap(torchft.process_group.ProcessGroupGloo(), "2bit")
    manager = torchft.Manager(pg=pg, ...)   # its DDP, HSDP, LocalSGD, DiLoCo unchanged
    zeropp.comm_stats(pg)                   # replica-to-replica bytes, as inter-node

Codecs: "int8", "int4" and "2bit" (error feedback at 4 bits and below; see
allreduce.py, [Note: both hops]), and "fp32" (torchft's own bytes, counted).
torchft is an optional dependency: `pip install 'zeropp[ft]'`.
"""

from __future__ import annotations

from typing import Any, Optional

from .allreduce import CODECS, CompressedAllReduce

__all__ = ["wrap", "CODECS", "CompressedAllReduce"]


def wrap(pg: Any, codec: str = "2bit", *, block_size: int = 2048,
         error_feedback: Optional[bool] = None) -> Any:
    """torchft's process group `pg` (ProcessGroupGloo, ProcessGroupNCCL, ...) with its
    all-reduce sent by zeropp's `codec`; pass the result to `torchft.Manager(pg=...)`."""
    try:
        from torchft.process_group import ProcessGroup
    except ImportError as e:
        raise ImportError("zeropp.ft.wrap needs torchft: pip install 'zeropp[ft]' "
                          f"({e})") from None
    if not isinstance(pg, ProcessGroup):
        raise TypeError(f"zeropp.ft.wrap: pg must be a torchft process group (e.g. "
                        f"torchft.process_group.ProcessGroupGloo()), got {type(pg).__name__}")
    from .group import CompressedGroup
    return CompressedGroup(pg, codec, block_size=block_size, error_feedback=error_feedback)
