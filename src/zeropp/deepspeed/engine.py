"""DeepSpeedEngine: DeepSpeed's training-engine surface over a zeropp-sharded
model, so a DeepSpeed script runs on zeropp by changing its import
(`import zeropp as deepspeed`; `zeropp.initialize` builds it).

The loop DeepSpeed scripts write, per micro-batch:
    loss = engine(batch); engine.backward(loss); engine.step()
`backward` scales the loss by 1/gradient_accumulation_steps (and by the fp16
loss scale) and runs autograd (a direct `loss.backward()` gets the same gradients:
direct_backward.py); zeropp reduces each unit's gradient into the
shards as it goes (inside `coalesce_grad_reduction()`, grad_sync.py: once, at
the block's exit). `step` counts micro-steps and, at an accumulation boundary
((micro_steps + 1) % gas == 0), unscales, takes the global gradient norm and
clips it (`gradient_clipping`), skips the update if the norm is not finite,
else steps the optimizer and then the LR schedule, zeroes the gradients and
advances global_steps / global_samples (DeepSpeed's counters: a skipped step
counts too, the schedule does not advance on one). Checkpoints are zeropp's own
sharded, pickle-free format in `save_dir/<tag>/`, with DeepSpeed's `latest` file.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from ..optim import clip_grad_norm_
from ..shard import get_state
from ..unit_hooks import _graph_task
from .config import DSConfig, LossScaling
from .direct_backward import through
from .engine_checkpoints import EngineCheckpoints
from .errors import EngineAssertionError
from .grad_sync import GradSyncContexts
from .parameters import master_shards


class LossScaler:
    """fp16's loss scale with DeepSpeed's dynamic rule: an overflow halves the
    scale (after `hysteresis` overflows in a row; never below min_loss_scale,
    and an overflow at the minimum is an error), and every `loss_scale_window`
    steps without one double it. Static when `loss_scale` > 0."""

    def __init__(self, cfg: LossScaling) -> None:
        self.cfg = cfg
        self.dynamic = cfg.static == 0
        self.scale = cfg.static if not self.dynamic else 2.0 ** cfg.initial_scale_power
        self.cur_iter, self.last_overflow_iter = 0, -1
        self.cur_hysteresis = cfg.hysteresis

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        c = self.cfg
        if overflow:
            if c.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.scale <= c.min_loss_scale:
                    raise FloatingPointError(
                        f"zeropp: fp16 gradients overflow at the minimum loss scale "
                        f"{c.min_loss_scale:g}; lower the learning rate or use bf16")
                self.scale = max(self.scale / 2, c.min_loss_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if c.consecutive_hysteresis:
                self.cur_hysteresis = c.hysteresis
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % c.loss_scale_window == 0:
                if not c.consecutive_hysteresis:
                    self.cur_hysteresis = c.hysteresis
                self.scale *= 2
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "cur_iter": self.cur_iter,
                "last_overflow_iter": self.last_overflow_iter,
                "cur_hysteresis": self.cur_hysteresis}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self.cur_iter = sd["scale"], sd["cur_iter"]
        self.last_overflow_iter, self.cur_hysteresis = sd["last_overflow_iter"], sd["cur_hysteresis"]


class DeepSpeedEngine(GradSyncContexts, EngineCheckpoints, nn.Module):
    """Made by `zeropp.initialize`; see the module docstring. Attribute access
    falls through to the model (`engine.generate`, ...)."""

    def __init__(self, module: nn.Module, ds: DSConfig,
                 optimizer: Optional[torch.optim.Optimizer],
                 lr_scheduler: Any, training_dataloader: Any, device: torch.device) -> None:
        super().__init__()
        self.module = module
        self._config = ds
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.training_dataloader = training_dataloader
        self.device = device
        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.loss_scaler = LossScaler(ds.fp16) if ds.fp16 is not None else None
        self.global_steps = self.global_samples = self.micro_steps = self.skipped_steps = 0
        self._backwards = 0
        self._step_applied = False
        self._is_compiled = False
        self._global_grad_norm: Optional[float] = None
        self._is_gradient_accumulation_boundary: Optional[bool] = None  # DeepSpeed's name
        self._scaled = False  # a loss went through scale(): its backward is the caller's
        self._in_backward = False  # inside backward()'s autograd call
        self._in_step = False  # inside step()
        self._task = -1  # the last backward that reached an output (_direct)
        # DeepSpeed's set of modules whose gradients it reduces as sparse: zeropp reduces
        # every gradient dense, so none (checkpoint helpers compare it across engines).
        self.sparse_tensor_module_names: set = set()
        if optimizer is not None:  # DeepSpeed's optimizers say whether they need scale()
            optimizer.needs_scaler = lambda: self.loss_scaler is not None
            # ... and whether the last step was skipped, from the start: accelerate reads it
            # only if present when it wraps the optimizer (else its schedule steps anyway).
            optimizer.overflow = False

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return through(self, self.module(*args, **kwargs))  # (direct_backward.py)

    # ---- the config's numbers ----------------------------------------------------------
    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self._config.grad_accum

    def managed_gradient_accumulation(self) -> bool:
        """False with "managed_gradient_accumulation": false (every step() is a boundary)."""
        return self._config.managed_accumulation

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def steps_per_print(self) -> Optional[int]:
        return self._config.steps_per_print

    def zero_optimization_stage(self) -> int:
        return 3

    def zero_optimization(self) -> bool:
        return True

    def bf16_enabled(self) -> bool:
        return self._config.bf16

    bfloat16_enabled = bf16_enabled  # DeepSpeed's own name for it

    def fp16_enabled(self) -> bool:
        return self._config.fp16 is not None

    def dynamic_loss_scale(self) -> bool:
        return self.loss_scaler is not None and self.loss_scaler.dynamic

    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def get_lr(self) -> list[float]:
        if self.optimizer is None:
            return []
        return [g.get("lr", 0.0) for g in self.optimizer.param_groups]

    def get_mom(self) -> list:
        if self.optimizer is None:
            return []
        return [g.get("momentum", g.get("betas")) for g in self.optimizer.param_groups]

    @property
    def config(self) -> dict:
        """The DeepSpeed config as a dict (DeepSpeed's `engine.config`; the model's
        own config is `engine.module.config`)."""
        return self._config.raw

    def zero_optimization_partition_weights(self) -> bool:
        return True

    def zero_optimization_partition_gradients(self) -> bool:
        return True

    def zero_offload_optimizer(self) -> bool:
        return False

    def zero_offload_param(self) -> bool:
        return False

    zero_cpu_offload = zero_offload_optimizer

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether a model save gathers the full weights: the config's
        `stage3_gather_16bit_weights_on_model_save`, true when unset (zeropp's
        default; DeepSpeed's is false, which leaves `save_model` only a checkpoint)."""
        zo = self._config.raw.get("zero_optimization") or {}
        v = zo.get("stage3_gather_16bit_weights_on_model_save",
                   zo.get("gather_16bit_weights_on_model_save", True))
        return v if isinstance(v, bool) else True

    def get_global_grad_norm(self) -> Optional[float]:
        """The global gradient norm of the last boundary step, before clipping."""
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    # ---- the loop -----------------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._is_gradient_accumulation_boundary is not None:
            return self._is_gradient_accumulation_boundary
        if not self._config.managed_accumulation:  # the caller's step() is the boundary,
            return self._in_step                   # while it runs (DeepSpeed's answer)
        return (self.micro_steps + 1) % self._config.grad_accum == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        if not self._config.managed_accumulation:
            raise EngineAssertionError(
                "zeropp engine.set_gradient_accumulation_boundary(): not with "
                "\"managed_gradient_accumulation\": false, where every step() is the caller's "
                "boundary")
        self._is_gradient_accumulation_boundary = bool(is_boundary)

    def _need_optimizer(self, what: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"zeropp engine.{what}(): no optimizer; pass one to "
                               "zeropp.initialize or add an \"optimizer\" section to the config")

    def scale(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        """The loss as `backward` differentiates it: divided by
        gradient_accumulation_steps, times the fp16 loss scale; for a backward the
        caller runs (`engine.scale(loss).backward()`)."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise EngineAssertionError("zeropp engine.scale(loss): loss must be a scalar tensor")
        return self._loss_scaled(self._per_micro_step(loss, scale_wrt_gas))

    def _per_micro_step(self, loss: torch.Tensor, scale_wrt_gas: bool) -> torch.Tensor:
        gas = self._config.grad_accum
        return loss / gas if scale_wrt_gas and gas > 1 else loss

    def _loss_scaled(self, loss: torch.Tensor) -> torch.Tensor:
        self._scaled = True
        self._backwards += 1  # micro-batches since the last step (backward or scale)
        return loss.float() * self.loss_scaler.scale if self.loss_scaler is not None else loss

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of `loss` / gradient_accumulation_steps (times the fp16 loss
        scale); returns the loss so scaled by accumulation, as DeepSpeed does."""
        self._need_optimizer("backward")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("zeropp engine.backward(loss): loss must be a scalar tensor")
        loss = self._per_micro_step(loss, scale_wrt_gas)
        scaled, self._in_backward = self._loss_scaled(loss), True
        try:
            scaled.backward(retain_graph=retain_graph)
        finally:
            self._in_backward = self._scaled = False
        return loss

    def allreduce_gradients(self, bucket_size: Any = None) -> None:
        """DeepSpeed's explicit reduction after a backward: zeropp reduces each unit's
        gradient as the backward goes and waits for all at its end, so this only
        makes sure none is still in flight."""
        get_state(self.module).reducer.drain()

    def _direct(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient reaching one of forward's outputs (direct_backward.py): as it is
        under backward() or scale() (until that backward ends); a direct backward's divided
        by gradient_accumulation_steps, and counted once as a micro-batch."""
        task, first = _graph_task(), False
        if task != self._task:
            self._task, first = task, True
        if self._in_backward or self._scaled:
            if first and self._scaled and not self._in_backward:
                Variable._execution_engine.queue_callback(self._end_scaled)
            return grad
        if self.loss_scaler is not None:
            raise RuntimeError("zeropp engine: Loss scaling is required with fp16: call "
                               "engine.backward(loss) or engine.scale(loss).backward(), not "
                               "loss.backward()")
        self._backwards += first  # (backward() and scale() count theirs)
        gas = self._config.grad_accum
        return grad / gas if gas > 1 else grad

    def _end_scaled(self) -> None:
        self._scaled = False

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        """Count a micro-step; at an accumulation boundary, update (see the module
        docstring)."""
        self._need_optimizer("step")
        self._refuse_inside_no_sync("step")
        if get_state(self.module).gathered_depth:
            raise RuntimeError("zeropp engine.step() inside zeropp.gathered(): the gathered "
                               "weights would go stale; step after the context")
        self._step_applied, self._in_step = False, True
        try:
            if self.is_gradient_accumulation_boundary():
                self._take_step(lr_kwargs)
        finally:
            self._in_step = False
        self.micro_steps += 1

    def _take_step(self, lr_kwargs: Optional[dict]) -> None:
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        if scale != 1.0:
            for g in self.optimizer.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.grad.div_(scale)
        clip = self._config.gradient_clipping
        norm = float(clip_grad_norm_(self.module, clip if clip > 0 else math.inf))
        if not math.isfinite(norm):
            norm = math.inf  # (NaN included)
        overflow = not math.isfinite(norm) and (self.loss_scaler is not None
                                                or self._config.skip_non_finite)
        if overflow:
            self.skipped_steps += 1
        else:
            self.optimizer.step()
            if self.lr_scheduler is not None:
                with warnings.catch_warnings():
                    # torch's check that optimizer.step ran first cannot see the
                    # optimizer a client schedule was re-pointed to (it did run).
                    warnings.filterwarnings("ignore", message=".*optimizer.step\\(\\)")
                    self.lr_scheduler.step(**(lr_kwargs or {}))
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        self.optimizer.overflow = overflow
        self.optimizer.zero_grad(set_to_none=True)
        for p in master_shards(self.module):  # trainable ones in no param group too
            p.grad = None
        if not (overflow and self.loss_scaler is not None):  # (DeepSpeed's ZeRO-3 returns
            self._global_grad_norm = norm               # before its norm at an fp16 overflow)
        self._step_applied = not overflow
        spp = self._config.steps_per_print
        if spp and (self.global_steps + 1) % spp == 0 and self.global_rank == 0:
            scale_txt = f", loss_scale={self.loss_scale():g}" if self.loss_scaler else ""
            print(f"[zeropp] step={self.global_steps + 1}, skipped={self.skipped_steps}, "
                  f"lr={self.get_lr()}{scale_txt}", flush=True)
        self.global_steps += 1
        if self._config.managed_accumulation:
            self.global_samples += self._config.train_batch_size
        else:  # the caller's step() ends a varying number of micro-batches
            per_micro = self._config.train_batch_size // self._config.grad_accum
            self.global_samples += per_micro * max(1, self._backwards)
        self._backwards = 0

    def compile(self, backend: Optional[str] = None, compile_kwargs: Optional[dict] = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's: compile the module in place (`nn.Module.compile`), once. Each
        unit's compute compiles; its gathers, frees and reductions run eagerly in its
        hooks, a graph break at each unit's boundary (docs/compile.md)."""
        if schedule is not None or compiled_autograd_enabled:
            raise NotImplementedError(
                "zeropp engine.compile(): DeepCompile's schedule and compiled autograd "
                "are not supported; call compile(backend=..., compile_kwargs=...)")
        if self._is_compiled:
            return
        kwargs = dict(compile_kwargs or {})
        given = kwargs.pop("backend", None)  # the argument wins, as in DeepSpeed
        self.module.compile(backend=backend or given or "inductor", **kwargs)
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._is_compiled

    # ---- memory ------------------------------------------------------------------------
    def empty_partition_cache(self) -> None:
        """Release every unit's gathered weights (persistent ones too) and hpZ
        secondaries (not the qWD copies, which are training state; nor what
        zeropp.gathered() holds). The next forward gathers afresh. Call it on every
        rank (the routes must agree)."""
        st = get_state(self.module)
        for u in st.units:
            u.free()
            if not u.pins:
                for f in u.flats:
                    f.free(let_go=True, force=True)  # (a persistent flat)
                    if not f.buffer.weights.delta:  # (qWD's copies are kept across steps)
                        f.buffer.invalidate()

    def destroy(self) -> None:
        """DeepSpeed frees the engine's buffers here (Trainer and accelerate call it
        when they let an engine go): gathered weights and hpZ secondaries are
        released and pending reductions finished. The model stays usable."""
        get_state(self.module).reducer.drain()
        self.empty_partition_cache()
