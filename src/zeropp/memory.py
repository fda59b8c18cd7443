"""Memory accounting: where this rank's bytes go under zeropp.

ZeRO-3 promises 16 bytes per parameter / W for the training state (fp32 master, gradient, two
AdamW moments) plus the full weights of the units gathered at one time. `memory_stats(model,
optimizer)` says what this rank holds, by kind, from the tensors themselves (storage sizes, not
estimates), and the peak of gathered units' full weights, which `GatherMeter` follows through
gathers and frees: with prefetch, at most `prefetch_depth + 1` units in forward. How freed host
memory goes back to the OS: host_memory.py.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .quant import scratch_bytes
from .shard import get_state


def _bytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


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
    st = get_state(model)
    flats = st.flats
    out = {
        "master_shards": sum(_bytes(f.primary_shard) for f in flats),
        "gradient_shards": sum(_bytes(f.primary_shard.grad) for f in flats),
        "optimizer_state": _optimizer_bytes(optimizer, flats),
        "secondary_shards": sum(f.buffer.secondary_bytes for f in flats),
        "error_feedback": sum(_bytes(getattr(f.buffer.codec, "residual", None)) for f in flats),
        "unreduced_grads": sum(_bytes(f.grads.grad) for f in flats if f.trainable),
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
    by_storage = {v.untyped_storage().data_ptr(): v for p, state in opt.state.items()
                  if id(p) in ours for v in state.values() if isinstance(v, torch.Tensor)}
    return sum(map(_bytes, by_storage.values()))  # a storage shared by tensors counts once
