"""Memory accounting: where this rank's bytes go under zeropp.

ZeRO-3 promises 16 bytes per parameter / W for the training state (fp32 master,
gradient, two AdamW moments) plus the full weights of the units gathered at one
time. `memory_stats(model, optimizer)` says what this rank holds, by kind, from
the tensors themselves (storage sizes, not estimates), and the peak of gathered
units' full weights, which `GatherMeter` follows as gathers allocate and frees
release: with prefetch it is bounded by `prefetch_depth + 1` units in forward.

[Note: host memory that freed buffers keep]
On the CPU every step allocates and frees unit-sized buffers (gathered weights,
full gradients, wire buffers), some on the reduce threads. glibc serves a large
allocation by mmap and returns it on free, but after the first such free it
raises its mmap threshold to that size, so later unit-sized buffers come from
heap arenas (one per thread) that fragment and rarely shrink: the process keeps
the peak of every thread's arena. `release_freed_host_memory` pins the threshold
(unless MALLOC_MMAP_THRESHOLD_ is set, or ZEROPP_KEEP_MALLOC=1), as `zeropp.shard`
does for a CPU model, at `mmap_threshold_for(parameters)`:
- none below 100M parameters: there the page faults of buffers mmap'd afresh every
  step cost more time than the memory the heap keeps (at 50M parameters the pin cost
  2.1x the step for 25% less peak RSS);
- 128 KiB (glibc's own starting value) from 100M: there every buffer of zeropp's is
  over 1 MiB anyway, and what sits between is the model's activations and their
  gradients, which fragmented the heap in backward; pinned, the rank peaks lower and
  keeps no freed memory, at the same step time.
The measurements behind both, and the 1 MiB setting they replaced, are in
docs/notebook.md ("Moved out of the code", memory.py).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Optional

import torch
from torch import nn

from .quant import scratch_bytes


def _bytes(t: Optional[torch.Tensor]) -> int:
    if t is None:
        return 0
    return t.untyped_storage().nbytes()


class GatherMeter:
    """Full-weight buffers alive now and at peak (bytes and units), updated by
    FlatParam when a gather allocates its buffer and when it is freed."""

    def __init__(self) -> None:
        self.alive: dict[int, tuple[Any, int]] = {}  # id(flat) -> (flat, bytes)
        self.peak_bytes = self.peak_units = 0

    def allocated(self, flat: Any, nbytes: int) -> None:
        self.alive[id(flat)] = (flat, nbytes)
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.peak_units = max(self.peak_units, self.units)

    def freed(self, flat: Any) -> None:
        self.alive.pop(id(flat), None)

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.alive.values())

    @property
    def units(self) -> int:
        return len({id(f.unit) for f, _ in self.alive.values()})

    def reset_peak(self) -> None:
        self.peak_bytes, self.peak_units = self.bytes, self.units


def memory_stats(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                 reset_peak: bool = False) -> dict[str, int]:
    """This rank's bytes by kind (see the module docstring):

      master_shards       the fp32 primary shards (optimizer's parameters)
      gradient_shards     their .grad
      optimizer_state     state tensors of `optimizer` over the shards (0 without it)
      secondary_shards    hpZ secondaries / qWD copies kept between gathers
      error_feedback      qgZ's residuals (error feedback)
      unreduced_grads     full gradients a backward left that are not reduced yet
      gathered_now        full weights of units gathered right now
      buffers             the model's buffers
      scratch             reused temporaries of error feedback and qWD's deltas (quant.py)
      total               the sum of the above
      gathered_peak, gathered_units_peak
                          the most full-weight bytes / units alive at once since the
                          last reset (`reset_peak=True` resets after reading)
    """
    from .shard import get_state
    st = get_state(model)
    flats = st.flats
    out = {
        "master_shards": sum(_bytes(f.primary_shard) for f in flats),
        "gradient_shards": sum(_bytes(f.primary_shard.grad) for f in flats),
        "optimizer_state": _optimizer_bytes(optimizer, flats),
        "secondary_shards": sum(_bytes(f.weights.secondary) for f in flats),
        "error_feedback": sum(_codec_bytes(f.grad_codec) for f in flats),
        "unreduced_grads": sum(_bytes(f.grad) for f in flats if f.trainable),
        "gathered_now": st.meter.bytes,
        "buffers": sum(_bytes(b) for b in model.buffers()),
        "scratch": scratch_bytes(),
    }
    out["total"] = sum(out.values())
    out["gathered_peak"], out["gathered_units_peak"] = st.meter.peak_bytes, st.meter.peak_units
    if reset_peak:
        st.meter.reset_peak()
    return out


def _optimizer_bytes(opt: Optional[torch.optim.Optimizer], flats: list) -> int:
    if opt is None:
        return 0
    ours = {id(f.primary_shard) for f in flats}
    seen: set[int] = set()
    total = 0
    for p, state in opt.state.items():
        if id(p) not in ours:
            continue
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                total += _bytes(v)
    return total


def _codec_bytes(codec: Any) -> int:
    return 0 if codec is None else _bytes(getattr(codec, "residual", None))


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
        libc = ctypes.CDLL("libc.so.6")
        if libc.mallopt(-3, threshold):  # -3: M_MMAP_THRESHOLD
            _pinned = threshold
    except (OSError, AttributeError):  # not glibc
        return False
    return _pinned is not None
