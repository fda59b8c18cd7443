"""Host memory that freed buffers keep, and how zeropp gives it back to the OS.

[Note: host memory that freed buffers keep]
On the CPU every step allocates and frees unit-sized buffers (gathered weights, full gradients,
wire buffers), some on the reduce threads. glibc serves a large allocation by mmap and returns
it on free, but after the first such free it raises its mmap threshold to that size, so later
unit-sized buffers come from heap arenas (one per thread) that fragment and rarely shrink: the
process keeps the peak of every thread's arena. `release_freed_host_memory` pins the threshold
(unless MALLOC_MMAP_THRESHOLD_ is set, or ZEROPP_KEEP_MALLOC=1), as `zeropp.shard` does for a
CPU model, at `mmap_threshold_for(parameters)`:
- none below 100M parameters: page faults of buffers mmap'd afresh every step cost more time
  than the memory the heap keeps (at 50M the pin cost 2.1x the step for 25% less peak RSS);
- 128 KiB (glibc's own starting value) from 100M: every zeropp buffer is over 1 MiB anyway, and
  what sits between is the model's activations and their gradients, which fragmented the heap in
  backward; pinned, the rank peaks lower and keeps no freed memory, at the same step time.
The measurements behind both, a 1 MiB threshold among the settings compared, are in
docs/notebook.md ("Moved out of the code", memory.py).
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

LARGE_MODEL_PARAMS = 100_000_000  # no pin below (see the note)
_pinned: Optional[int] = None  # the threshold this process pinned, once it has


def mmap_threshold_for(parameters: int) -> Optional[int]:
    """The mmap threshold zeropp pins for a CPU model of `parameters`, None for none
    (see the note)."""
    return 128 << 10 if parameters >= LARGE_MODEL_PARAMS else None


def release_freed_host_memory(threshold: int = 1 << 20) -> bool:
    """Pin glibc's mmap threshold at `threshold` bytes (see the note); a later call
    may lower it, never raise it. Returns whether a pinned threshold is in effect."""
    global _pinned
    if _pinned is not None and _pinned <= threshold:
        return True
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or os.environ.get("ZEROPP_KEEP_MALLOC") == "1":
        return False
    try:
        if ctypes.CDLL("libc.so.6").mallopt(-3, threshold):  # -3: M_MMAP_THRESHOLD
            _pinned = threshold
    except (OSError, AttributeError):  # not glibc
        return False
    return _pinned is not None
