"""The engine's gradient-synchronization contexts under DeepSpeed's names:
`coalesce_grad_reduction()` (the backwards of one optimizer step reduce once,
at the block's exit; the mechanism is coalesce.py) and `no_sync()`, which
DeepSpeed refuses under ZeRO-2/3 and so does zeropp (ZeRO-3 only)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .coalesce import coalesced_reduction
from .errors import EngineAssertionError


class GradSyncContexts:
    """Mixed into DeepSpeedEngine (engine.py)."""

    inside_no_sync_ctxt = False  # DeepSpeed's flag: a coalesce_grad_reduction() block is open
    pipeline_parallelism = False  # zeropp has no pipeline engine (DeepSpeed's attribute)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Refused, as DeepSpeed refuses it under ZeRO-2/3: each rank's gradient
        shard is only made by the reduction. coalesce_grad_reduction() is the
        ZeRO-3 way to reduce once for several backwards."""
        raise EngineAssertionError("zeropp engine.no_sync(): no_sync context manager is "
                                   "incompatible with gradient partitioning logic of ZeRO stage "
                                   "3; use engine.coalesce_grad_reduction()")
        yield  # unreachable; makes this a context manager that raises on entry

    @contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """One block is one optimizer step's micro-batches: the `backward()` calls
        inside keep each unit's gradient local and unreduced on every rank (summed
        over the block, in fp32), and at the exit each unit's gradient is
        reduce-scattered once, by the configured route (plain, qgZ), into the
        master shards' `.grad`; then `step()`. The reduction bytes are one
        backward's instead of one per backward.

        Memory: every trainable unit's full, unsharded fp32 gradient is held on
        every rank for the whole block (the model's fp32 size), where a backward
        outside holds at most `reduce_buckets` units' at a time.

        As in DeepSpeed: `step()` inside raises, so does nesting this or
        `no_sync()`; each backward still divides its loss by
        gradient_accumulation_steps (the exit divides by the world size only),
        so the gradients equal one reduction per backward up to the order of the
        fp32 sums; at the exit the accumulation boundary is what it was at the
        entry (a `set_gradient_accumulation_boundary` inside is undone);
        `safe_get_full_grad` inside returns this rank's pre-reduce value. Unlike
        DeepSpeed's, several blocks before one `step()` accumulate. Collective at
        the exit; a block left by an exception reduces nothing (its gradients
        are dropped)."""
        self._need_optimizer("coalesce_grad_reduction")
        if not self._config.managed_accumulation:
            raise EngineAssertionError(
                "zeropp engine: coalesce_grad_reduction is not supported with "
                "managed_gradient_accumulation=False; the caller already owns the "
                "accumulation boundary via step()")
        if self.pipeline_parallelism:
            raise NotImplementedError("zeropp engine: coalesce_grad_reduction is not supported "
                                      "under pipeline parallelism")
        if self.inside_no_sync_ctxt:
            raise EngineAssertionError("zeropp engine: coalesce_grad_reduction cannot be nested "
                                       "inside another no_sync context")
        saved = self._is_gradient_accumulation_boundary
        self.inside_no_sync_ctxt = True
        try:
            with coalesced_reduction(self.module):
                yield
        finally:
            self.inside_no_sync_ctxt = False
            self._is_gradient_accumulation_boundary = saved

    def _refuse_inside_no_sync(self, what: str) -> None:
        if self.inside_no_sync_ctxt:
            raise EngineAssertionError(
                f"zeropp engine.{what}() inside coalesce_grad_reduction(): it is illegal to "
                f"call it inside a no_sync context; the block's gradients are reduced at its "
                f"exit, {what} after it")
