"""What both drivers share around the comm layer: the engine (`shard`) and the FSDP2
driver (`fsdp2.install`) make their comms with `make_comm`, watch optimizer steps
with `step_hooks`, and save and restore a buffer's comm state with `comm_state` /
`load_comm_state`. A driver supplies only which of its buffers an optimizer
updates and what it does before and after the step.

[Note: why optimizer steps are hooked]
hpZ's secondaries stand for one version of the master shards: after a step they
are stale (qWD: a delta is due). Version counters alone cannot tell a step from
any other write (fused optimizers update in place without bumping them), so both
drivers hook every optimizer's step globally (there is no engine object to call)
and act only for an optimizer that holds their shards.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from .collectives import Comm
from .config import Config
from .stats import CommStats
from .topology import Topology
from .weights import WeightPath


def make_comm(cfg: Config, topo: Topology, stats: CommStats) -> Comm:
    """The weight gathers' collectives over this rank's groups, checked first."""
    if topo.world_size % cfg.hpz_partition_size:
        raise ValueError(f"zeropp: hpz_partition_size={cfg.hpz_partition_size} must divide "
                         f"the world size {topo.world_size}")
    return Comm(topo, stats, cfg.hpz_partition_size, cfg.collective_timeout)


def step_hooks(owner: Any, select: Callable[[torch.optim.Optimizer], list],
               before: Callable[[list], None], after: Callable[[list], None]) -> None:
    """Run `before(items)` / `after(items)` around every optimizer step for which
    `select(optimizer)` (asked once per optimizer) is not empty, while `owner` lives
    (the hooks are removed when it dies: the callbacks must not hold it)."""
    chosen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def items(opt: torch.optim.Optimizer) -> list:
        if opt not in chosen:
            chosen[opt] = select(opt)
        return chosen[opt]

    def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if items(opt):
            before(items(opt))

    def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if items(opt):
            after(items(opt))
    handles = (register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post))
    weakref.finalize(owner, lambda: [h.remove() for h in handles])


def held_params(opt: torch.optim.Optimizer) -> set[int]:
    """Ids of the parameters `opt` updates."""
    return {id(p) for g in opt.param_groups for p in g["params"]}


def comm_state_file(directory: Union[str, os.PathLike], rank: int) -> Path:
    """Where a driver that keeps no files of its own (FSDP2 beside DCP) puts a rank's
    comm state."""
    return Path(directory) / f"zeropp_rank{rank}.pt"


def comm_state(path: Optional[WeightPath], codec: Any) -> dict[str, torch.Tensor]:
    """One buffer's comm state an exact resume needs, different on every rank: qWD's
    copies (and whether a delta is due), qgZ's error-feedback residuals."""
    out = {}
    if path is not None:
        out.update({f"weights/{k}": v for k, v in path.state().items()})
    if codec is not None:
        out.update({f"grad/{k}": v for k, v in codec.state().items()})
    return out


def load_comm_state(path: Optional[WeightPath], codec: Any, saved: dict[str, torch.Tensor],
                    device: torch.device) -> None:
    """Restore `comm_state` after the buffer's master shard was loaded (or start
    afresh: the next gather is then a full one from the loaded masters)."""
    parts: dict[str, dict] = {"weights": {}, "grad": {}}
    for k, v in saved.items():
        kind, _, name = k.partition("/")
        if kind in parts:
            parts[kind][name] = v
    if path is not None:
        path.load_state(parts["weights"], device)
    if codec is not None:
        codec.load_state(parts["grad"], device)
