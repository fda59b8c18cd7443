"""ShardedBuffer: one flat buffer's comm side, the object both drivers hold.

What travels for a flat buffer cut into W shards (layout.py), and what it keeps between steps: its
weight path (weights/: each gather's route, hpZ's secondary, qWD's copies), its gradient route
(grads/: ZeRO-3's ring or qgZ's hops, with error feedback), and the master version a secondary
stands for. It answers the optimizer-step hooks (`step_hooks`), `zeropp.refresh` (`invalidate`) and
checkpoints (`state` / `load_state`). The engine's FlatParam holds one per flat, the FSDP2 driver
one per region of a module's chunk (fsdp2/comms.py).

[Note: why optimizer steps are hooked]
hpZ's secondaries stand for one master version, stale after a step (qWD: a delta is due). Version
counters cannot tell a step from other writes (fused optimizers skip bumping them), so both drivers
hook every optimizer's step globally (no engine object to call), acting only for their shards'.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from .collectives import Comm
from .config import Config
from .grads import route_for
from .layout import ShardLayout
from .stats import CommStats
from .topology import Topology
from .weights import WeightPath, WeightSpec


class ShardedBuffer:
    """The weight path and gradient route of a buffer cut as `layout` says. `version`: what
    its master weights are now (`version_of`); `bits`: the weights travel as `bits`-bit
    wire bytes (None: at the compute dtype); `stored_as_wire`: the master shard is those
    bytes already; `route`: False: none here (FSDP2's driver reduces exactly or sets qgZ's)."""

    def __init__(self, layout: ShardLayout, topo: Topology, cfg: Config, *,
                 version: Callable[[], tuple], bits: Optional[int], trainable: bool,
                 stored_as_wire: bool = False, route: bool = True) -> None:
        self.layout, self.version = layout, version
        spec = WeightSpec(**vars(layout), bits=bits, stored_as_wire=stored_as_wire)
        self.weights = WeightPath(spec, topo, cfg, trainable=trainable, version=version)
        self.route = route_for(cfg, block=layout.block) if trainable and route else None

    @property
    def codec(self) -> Any:
        """The gradient route's state (qgZ's inter-node codec), or None."""
        return self.route.codec if self.route is not None else None

    # ---- the secondary's life across optimizer steps and refreshes ----------------
    def before_step(self) -> None:
        """A secondary made stale by anything but a step is dropped."""
        if self.weights.secondary is not None:
            self.weights.secondary.before_step(self.version())

    def after_step(self) -> None:
        """The secondary goes stale (qWD: a delta is due)."""
        if self.weights.secondary is not None:
            self.weights.secondary.after_step(self.version())

    def invalidate(self) -> None:
        """The next gather is a full one from the master shards."""
        if self.weights.secondary is not None:
            self.weights.secondary.invalidate()

    @property
    def secondary_bytes(self) -> int:
        sec = self.weights.secondary
        return 0 if sec is None or sec.pieces is None else sec.pieces.nbytes

    # ---- checkpoints ----------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """The comm state an exact resume needs: qWD's copies (and whether a delta is
        due), qgZ's error-feedback residuals."""
        out, sec = {}, self.weights.secondary
        if self.weights.delta:
            out = {f"weights/{k}": v for k, v in sec.state(self.version()).items()}
        if self.codec is not None:
            out.update({f"grad/{k}": v for k, v in self.codec.state().items()})
        return out

    def load_state(self, saved: dict[str, torch.Tensor], device: torch.device) -> None:
        """Restore `state()` after the master shard was loaded, at the same layout (or
        start afresh: the next gather is then a full one from the loaded masters)."""
        parts = {kind: {k.removeprefix(f"{kind}/"): v for k, v in saved.items()
                        if k.startswith(f"{kind}/")} for kind in ("weights", "grad")}
        self.invalidate()
        sec, mine = self.weights.secondary, parts["weights"].get("secondary")
        if self.weights.delta and mine is not None and (mine.dtype, mine.numel()) == (
                torch.uint8, self.layout.world_size // sec.p * self.weights.spec.wire_bytes):
            sec.load_state(parts["weights"], device, self.version())
        if self.codec is not None:
            self.codec.load_state(parts["grad"], device)


def version_of(tensors: list[torch.Tensor], steps: Callable[[], int] = lambda: 0
               ) -> Callable[[], tuple]:
    """What master tensors are now: each one's version counter and storage (in-place
    writes, loads, replacement), and the optimizer steps seen (`steps`). A DTensor (FSDP2's
    shards) counts its own writes, not its local tensor's: both are read."""
    def version() -> tuple:
        out = [steps()]
        for t in tensors:
            x = getattr(t, "_local_tensor", t)
            out += (t._version, x._version, x.data_ptr())
        return tuple(out)
    return version


def make_comm(cfg: Config, topo: Topology, stats: CommStats) -> Comm:
    """The weight gathers' collectives over this rank's groups (hpZ's checked by hpz_group)."""
    return Comm(topo, stats, cfg.hpz_partition_size, cfg.collective_timeout)


def step_hooks(owner: Any, stats: CommStats, select: Callable[[torch.optim.Optimizer], list],
               before: Callable[[list], None] = lambda b: None,
               after: Callable[[list], None] = lambda b: None) -> None:
    """Around every optimizer step over the ShardedBuffers `select(optimizer)` returns (asked anew
    when its groups' sizes change: `add_param_group`; none: no-op), while `owner` lives (callbacks
    must not hold it): before, `before(buffers)` then each buffer's `before_step`; after, the step
    is counted (once for optimizers over parts of the model: at the first to step a parameter
    again), then `after(buffers)` (a driver's step count moves there), then each `after_step`."""
    chosen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    stepped: set[int] = set()  # ids of the parameters stepped since the last count

    def items(opt: torch.optim.Optimizer) -> list:
        sizes = tuple(len(g["params"]) for g in opt.param_groups)
        if chosen.get(opt, (None,))[0] != sizes:
            chosen[opt] = sizes, select(opt)
        return chosen[opt][1]

    def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if buffers := items(opt):
            before(buffers)
            for b in buffers:
                b.before_step()

    def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if buffers := items(opt):
            if (held := held_params(opt)) & stepped or not stepped:
                stepped.clear()
                stats.steps += 1
            stepped.update(held)
            after(buffers)
            for b in buffers:
                b.after_step()
    if not _HOOKED:
        _HOOKED.append((register_optimizer_step_pre_hook(_run_steps(0)),
                        register_optimizer_step_post_hook(_run_steps(1))))
    _STEPS[owner] = pre, post


# Each live owner's (pre, post) step callbacks, run by one pair of global hooks: an owner freed by a
# collection inside an optimizer step then removes nothing from the dict torch iterates there.
_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HOOKED: list = []


def _run_steps(i: int) -> Callable:
    def run(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for hooks in list(_STEPS.values()):
            hooks[i](opt, args, kwargs)
    return run


def held_params(opt: torch.optim.Optimizer) -> set[int]:
    """Ids of the parameters `opt` updates."""
    return {id(p) for g in opt.param_groups for p in g["params"]}
