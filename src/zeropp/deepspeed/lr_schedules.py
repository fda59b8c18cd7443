"""DeepSpeed's warmup learning-rate schedules, for configs that name them
(`"scheduler": {"type": "WarmupLR", "params": {...}}`), with DeepSpeed's
semantics (parameter names, defaults, formulas) so a run's learning rates match.

t = `last_batch_iteration`, starting at -1; the constructor writes the lr of
t = -1 into the optimizer; each `step()` advances t and writes the lr of the
new t. The engine steps the schedule after every applied optimizer step, so
optimizer step k (1-based) runs at the lr of t = k - 2, as in DeepSpeed.
W = max(2, warmup_num_steps), T = total_num_steps; warmup is
ln(t+1)/ln(W) ("log", the default) or t/W ("linear") of the way from min to max.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ..config import _is_int


def _positive_int(name: str, value: Any) -> int:
    if not (_is_int(value) and value > 0):
        raise ValueError(f"scheduler: {name}={value!r} is invalid; allowed: a positive integer")
    return value


class _Warmup:
    """Shared by the three schedules: per-group values, t, state dict."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_num_steps: int,
                 warmup_type: str, last_batch_iteration: int) -> None:
        _positive_int("warmup_num_steps", warmup_num_steps)
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"scheduler: warmup_type={warmup_type!r} is invalid; allowed: "
                             "'log' or 'linear'")
        self.optimizer = optimizer
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: Optional[list[float]] = None

    def _per_group(self, name: str, value: Any) -> list[float]:
        n = len(self.optimizer.param_groups)
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"scheduler: {name} has {len(value)} values for {n} param groups")
            return [float(v) for v in value]
        return [float(value)] * n

    def _warmup(self, t: int) -> float:
        if self.warmup_type == "log":
            return math.log(t + 1) / math.log(self.warmup_num_steps)
        return t / self.warmup_num_steps

    def _write(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = lrs

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        self.last_batch_iteration = (self.last_batch_iteration + 1 if last_batch_iteration is None
                                     else last_batch_iteration)
        self._write()

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise RuntimeError("scheduler: call step() first")
        return self._last_lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]


class WarmupLR(_Warmup):
    """From `warmup_min_lr` to `warmup_max_lr` (None: the optimizer's lr) over
    `warmup_num_steps`, then constant."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: Any = 0.0,
                 warmup_max_lr: Any = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.min_lrs = self._per_group("warmup_min_lr", warmup_min_lr)
        self.max_lrs = ([float(g["lr"]) for g in optimizer.param_groups] if warmup_max_lr is None
                        else self._per_group("warmup_max_lr", warmup_max_lr))
        if last_batch_iteration == -1:
            self._write()

    def _gamma(self, t: int) -> float:
        return self._warmup(t) if t < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:
        t = self.last_batch_iteration
        if t < 0:
            return list(self.min_lrs)
        g = self._gamma(t)
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR's warmup, then linear decay to 0 at `total_num_steps`."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_lr: Any = 0.0, warmup_max_lr: Any = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = _positive_int("total_num_steps", total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps,
                         warmup_type, last_batch_iteration)

    def _gamma(self, t: int) -> float:
        w = self.warmup_num_steps
        if t < w:
            return self._warmup(t)
        return max(0.0, (self.total_num_steps - t) / max(1.0, self.total_num_steps - w))


class WarmupCosineLR(_Warmup):
    """The optimizer's lr times a ratio: from `warmup_min_ratio` to 1 over the
    warmup, then a cosine down to `cos_min_ratio` at `total_num_steps`."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = _positive_int("total_num_steps", total_num_steps)
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.warmup_min_ratio, self.cos_min_ratio = float(warmup_min_ratio), float(cos_min_ratio)
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._write()

    def get_lr(self) -> list[float]:
        t, w = self.last_batch_iteration, self.warmup_num_steps
        if t < 0:
            ratio = 0.0
        elif t < w:
            ratio = self.warmup_min_ratio + self._warmup(t) * (1 - self.warmup_min_ratio)
        else:
            p = min(1.0, (t - w + 1) / max(1, self.total_num_steps - w))
            ratio = max(0.0, self.cos_min_ratio
                        + (1 - self.cos_min_ratio) * (1 + math.cos(math.pi * p)) / 2)
        return [lr * ratio for lr in self.org_lrs]


SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
             "WarmupCosineLR": WarmupCosineLR}
UNSUPPORTED = ("OneCycle", "LRRangeTest")
# DeepSpeed's list of its schedule names (accelerate checks a scheduler's class
# name against it); the unsupported two are refused when a config names them.
VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
