"""zeropp's collectives in FSDP2's custom-collective slots.

FSDP2 hands a module's all-gather an output of W chunks of its flat shard (the
parameter dtype; slot r is this rank's input) and its reduce-scatter an input of W
chunks (the reduce dtype) and a chunk to fill. Only the output is contracted:
- `WeightGather`: zero3 passes the chunks through (counted); qwZ gathers INT8 blocks
  (layout.py) and every rank dequantizes every piece, its own too, so all compute
  with the same weights; hpZ keeps this rank's column of the wire bytes
  (weights/hpz.py) while the sharded weights are unchanged (version counters,
  optimizer steps), and backward's gather runs from it inside the hpZ group, bit
  for bit the same.
- `GradReduce`: zero3 is the ring reduce-scatter; qgZ runs grads/qgz.py's two hops,
  the engine's route, with the module's own error feedback. Either returns the
  mean, scaled for FSDP2's op (AVG, SUM, PREMUL_SUM).
Both hold the module's `Buffers` (a ShardedBuffer per region, as the engine's
FlatParam holds), so step hooks and checkpoints reach each once. The gather's `wait`
(in FSDP2's copy-out) completes it, so FSDP2's prefetch of the next gather goes out
before this one is waited for.

[Note: reductions that complete at the end of backward]
FSDP2 discards what the reduce-scatter returns and uses its output at once. When it
only keeps views of it as the sharded gradients (fp32 / bf16 without HSDP, after
`zero_grad(set_to_none=True)`: no gradient to add to, no division or cast after, no
hook on the result, such as torchtitan's fault-tolerant all-reduce hook, or on the
gradients), nothing reads them before backward ends. Then qgZ's two hops of the
world's group run on the engine's reduce pipeline (grads/pipeline.py: two threads,
process groups of their own) while backward goes on; the end of backward (an
autograd callback after FSDP2's) and an optimizer step wait for them. Same functions,
same bytes: bit for bit the synchronous gradients. Any other call reduces synchronously.

[Note: a module with several parameter groups]
torchtitan shards an MoE block with per-parameter meshes (`shard_placement_fn`:
experts over the expert-FSDP mesh, the rest over the dp mesh): one FSDPParamGroup
per mesh. FSDP2's public setters refuse such a module, as one comm would serve
groups of different meshes (pytorch#173509). zeropp makes a comm per group and
`attach` writes each group's slots, the attributes those setters write (checked in
each setter's source first; tests/fsdp2/test_fsdp2_nd.py pins it).

[Note: a failed collective]
Every rank must choose the same route for a gather, and the route depends on the
secondaries a rank holds (weights/__init__.py). A collective that fails on one rank
(a timeout, a dead peer, an error between the wait and the copy-out) leaves its
secondaries unknown while its peers may hold theirs. So the first failure drops
every secondary of the model on that rank, and every later collective of the model
there is refused at once, naming the failure; the peers, which cannot complete a
collective without this rank, fail within their `collective_timeout` and do the
same. Every rank then holds no secondary and goes no further, alike: none goes on
alone on a route the others do not take. Going on means a restart from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ..buffer import ShardedBuffer
from ..collectives import CollectiveError, Comm
from ..config import Config
from ..grads.pipeline import ReducePipeline
from ..grads.qgz import QgzReduce
from ..layout import ShardLayout
from ..unit_hooks import _graph_task
from .regions import Kinds


def _check_group(comm: Comm, group: dist.ProcessGroup, what: str) -> None:
    if group.size() != comm.topo.world_size:
        raise NotImplementedError(
            f"zeropp.fsdp2: {what} over a group of {group.size()} ranks, not the module's "
            f"FSDP group of {comm.topo.world_size}: reshard_after_forward=int other than the "
            "group's ranks per node is not supported; use True, False or that number")


class Failures:
    """The first collective of an installed model that failed on this rank (the note),
    and how to drop the model's secondaries."""

    def __init__(self, drop: Callable[[], None] = lambda: None) -> None:
        self.first: Optional[str] = None
        self.drop = drop

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        if self.first is not None:
            raise CollectiveError(
                f"zeropp.fsdp2: {what} refused on rank {dist.get_rank()}: {self.first} failed "
                "here earlier, so the ranks may no longer agree on the secondaries they hold "
                "(every rank drops its own at a failure); restart from the last checkpoint")
        try:
            yield
        except BaseException as e:
            if self.first is None:
                why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                self.first = f"{what} ({why})"
                self.drop()
            raise


class _Finish(dist.Work):
    """What a gather returns to FSDP2, which waits on it in its copy-out (before the
    module runs): `wait` completes zeropp's gather there, so the collectives issued
    meanwhile (FSDP2's prefetch of the next module) overlap this one."""

    def __init__(self, complete: Callable[[], None]) -> None:
        super().__init__()
        self._complete = complete

    def wait(self, timeout: Any = None) -> bool:
        complete, self._complete = self._complete, lambda: None
        complete()
        return True


class Buffers(dict):
    """A module's ShardedBuffers (buffer.py), one per region kind (regions.py), made for
    the sizes FSDP2 hands over: a buffer anew at another gathered size (its route kept),
    a route anew at another block (a backward with other gradients: the error feedback,
    of another layout, dropped); never a route of another layout."""

    def __init__(self, comm: Comm, cfg: Config, version: Callable[[], tuple],
                 op: str = "reduce_scatter/qgz") -> None:
        super().__init__()
        self.comm, self.cfg, self.version, self.op = comm, cfg, version, op
        self.trained: dict[str, Optional[tuple]] = {}  # whose gradients a route's residuals are

    def of(self, kind: str, numel: int) -> ShardedBuffer:
        """Region `kind`'s buffer for a gathered size (W chunks) of `numel`."""
        old = self.get(kind)
        if old is None or old.layout.numel != numel:
            cfg = self.cfg
            self[kind] = ShardedBuffer(
                ShardLayout.of(numel, self.comm.topo.world_size, cfg), self.comm.topo, cfg,
                version=self.version, bits=cfg.weight_bits if cfg.quantized_weights else None,
                trainable=True, route=False)
            self[kind].route = old and old.route
        return self[kind]

    def route(self, kind: str, block: int, numel: int = 0, partial: bool = False,
              trained: Optional[tuple] = None) -> QgzReduce:
        """qgZ's route for region `kind`'s gradient in blocks of `block` (the region's
        buffer made for a gathered size of `numel` when it has none yet). `partial`: a
        chunk of some parameters only (Kinds.partial): a route of its own, without the error
        feedback, whose residuals belong to the positions of other parameters (an expert's
        residual was added to another's gradient: 2e4 times its norm). So a route anew for
        another set `trained` (Kinds.trained: adapters of one size trained in turn, the
        chunk the same size); one loaded from a checkpoint (None) takes the next set."""
        if partial:
            route = QgzReduce.from_config(replace(self.cfg, gradient_error_feedback=False),
                                          block=block)
            route.op = self.op
            return route
        buf = self.get(kind) or self.of(kind, numel)
        if buf.route is None or buf.route.block != block or self.trained.get(kind) not in (
                None, trained):
            buf.route = QgzReduce.from_config(self.cfg, block=block)
            buf.route.op = self.op
        self.trained[kind] = trained
        return buf.route

    def state(self) -> dict[str, dict[str, Any]]:
        """Every buffer's comm state by kind, with its gathered size and its route's block."""
        return {kind: {**buf.state(), "numel": buf.layout.numel,
                       **({"grad_block": buf.route.block} if buf.route else {})}
                for kind, buf in self.items()}

    def load_state(self, saved: dict[str, dict[str, Any]], device: torch.device) -> None:
        """`state()` back (buffers absent from it start afresh)."""
        for kind in dict.fromkeys([*self, *saved]):
            s = saved.get(kind, {})
            buf = self.of(kind, int(s["numel"])) if "numel" in s else self[kind]
            if "grad_block" in s:
                self.route(kind, int(s["grad_block"]))
            buf.load_state(s, device)


class _ModuleComm:
    """What a module's gather and reduction share; FSDP2's buffers are plain tensors."""

    def __init__(self, comm: Comm, cfg: Config, label: str, buffers: Buffers, kinds: Kinds,
                 failures: Failures) -> None:
        self.comm, self.cfg, self.label, self.buffers = comm, cfg, label, buffers
        self.kinds, self.failures = kinds, failures

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class WeightGather(_ModuleComm, AllGather):
    """zero3: FSDP2's own all-gather, counted. Otherwise each region of this rank's chunk
    (regions.py), padded to whole blocks, is the primary shard of its ShardedBuffer's
    weight path (weights/: qwZ, hpZ, the hierarchical gather, qWD; the engine's), and
    the full weights go into FSDP2's output."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work:
        what = f"the all-gather of module {self.label}"
        with self.failures.guard(what):
            finish = self._issue(output_tensor, input_tensor, group)

        def complete() -> None:
            with self.failures.guard(what):
                self.comm.unit = self.label
                finish()
        return _Finish(complete)

    def _issue(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
               group: dist.ProcessGroup) -> Callable[[], None]:
        """Start the module's gather; return what completes it into `output_tensor`."""
        comm, cfg = self.comm, self.cfg
        comm.unit = self.label
        if (group.size() == comm.topo.node_size < comm.topo.world_size
                and dist.get_process_group_ranks(group)
                == [comm.topo.global_rank(r) for r in comm.ranks["intra_node"]]):
            # reshard_after_forward=node size: the backward's gather of FSDP2's own
            # post-forward shard (of the weights this comm gathered), inside the node
            return comm.all_gather(output_tensor, input_tensor, group="intra_node",
                                   op="all_gather/fsdp2/post_forward").wait
        _check_group(comm, group, "an all-gather")
        if not (cfg.quantized_weights or cfg.hpz_partition_size > 1 or cfg.hierarchical_gather):
            return comm.all_gather(output_tensor, input_tensor, op="all_gather/fsdp2").wait
        if output_tensor.dtype == torch.uint8:
            raise NotImplementedError(
                f"zeropp.fsdp2: module {self.label} mixes parameter dtypes (FSDP2 gathers them "
                "as bytes); zeropp's weight routes need one dtype per module")
        w, c = comm.topo.world_size, input_tensor.numel()
        started = []  # every region's first collective goes out before any is waited for
        for region in self.kinds.regions(c):
            path = self.buffers.of(region.kind, region.numel * w).weights
            shard = region.take(input_tensor.view(1, c), path.spec.shard_numel)
            full = torch.empty(path.spec.padded_numel, dtype=output_tensor.dtype,
                               device=input_tensor.device)
            started.append((region, path, path.issue(comm, "fsdp2", shard, full)))

        def finish() -> None:
            for region, path, gather in started:
                path.finish(gather)
                region.put(gather.full.view(w, -1), output_tensor.view(w, c))
        return finish


class GradReduce(_ModuleComm, ReduceScatter):
    """zero3: the ring reduce-scatter; qgZ: each region's two quantized hops, its
    ShardedBuffer's gradient route."""

    def __init__(self, comm: Comm, cfg: Config, label: str, buffers: Buffers, kinds: Kinds,
                 failures: Failures, later: Optional[Later] = None, group: Any = None) -> None:
        super().__init__(comm, cfg, label, buffers, kinds, failures)
        self.later = later
        self.group = weakref.ref(group) if group is not None else lambda: None
        self.replica: Any = None  # HSDP: the mean across replicas (replicate.py)
        self.replicas: Optional[Comm] = None  # HSDP: the comm over the replicate group

    def _deferrable(self, dtype: torch.dtype) -> bool:
        """Whether FSDP2 only keeps views of this call's output until backward ends."""
        group = self.group()
        return (self.later is not None and self.replica is None and group is not None
                and group._all_reduce_hook is None and not group.force_sum_reduction_for_comms
                and dtype in (torch.float32, torch.bfloat16)
                and all(p.grad is None and p.dtype == dtype
                        and not getattr(p, "_post_accumulate_grad_hooks", None)
                        for p in self.kinds.params))

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> None:
        with self.failures.guard(f"the reduce-scatter of module {self.label}"):
            self._reduce(output_tensor, input_tensor, group, op)

    def _reduce(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                group: dist.ProcessGroup, op: Any) -> None:
        _check_group(self.comm, group, "a reduce-scatter")
        self.comm.unit = self.label
        w, c = self.comm.topo.world_size, output_tensor.numel()
        kind, ops = getattr(op, "op", op), dist.ReduceOp
        if kind not in (ops.AVG, ops.SUM, ops.PREMUL_SUM):
            raise NotImplementedError(f"zeropp.fsdp2: reduce-scatter op {op} is not supported "
                                      "(AVG, SUM and PREMUL_SUM are)")
        scale = float(op.factor) if kind == ops.PREMUL_SUM else 1.0 / w if kind == ops.AVG else 1.0
        param_group = self.group()
        if self.replica is None and self.replicas is not None and param_group is not None \
                and param_group.all_reduce_grads:
            # FSDP2 all-reduces the output over the replicas next, at full width: what
            # travels is counted, as for zeropp's own collectives
            self.replicas.record_ring("all_reduce/fsdp2/replicas", "world",
                                      output_tensor.nbytes, 2)
        if not self.cfg.quantized_gradients:
            total = self.comm.reduce_scatter_sum(input_tensor, op="reduce_scatter/fsdp2")
            output_tensor.copy_(total if scale == 1.0 else total * scale)
            return
        later, partial = self._deferrable(input_tensor.dtype), self.kinds.partial(c)
        trained = self.kinds.trained()
        for region in self.kinds.regions(c, grads=True):
            lay = ShardLayout.of(region.numel * w, w, self.cfg)
            g = region.take(input_tensor.view(w, c), lay.shard_numel)
            route = self.buffers.route(region.kind, lay.block, lay.numel, partial, trained)

            def put(mean: torch.Tensor, region: Any = region) -> None:  # mean: sum / W
                region.put((mean[:region.numel] * (scale * w)).view(1, -1),
                           output_tensor.view(1, c))
            if later:
                self.later.submit(self.label, g,
                                  lambda comm, g=g, route=route: route.first(comm, g),
                                  lambda comm, s, route=route, put=put: put(route.second(comm, s)))
            else:
                put(route.reduce(self.comm, g))


class Later:
    """The reductions that complete at the end of backward (the note), on `pipeline`."""

    def __init__(self, pipeline: ReducePipeline, failures: Failures) -> None:
        self.pipeline, self.failures = pipeline, failures
        self.task: Optional[int] = None  # the backward whose end drains (once queued)

    def submit(self, label: str, g: torch.Tensor, first: Callable, second: Callable) -> None:
        self.pipeline.submit(label, g, first, second)
        task = _graph_task()
        if task == -1:  # outside a backward: nothing to wait for the end of
            self.drain()
        elif task != self.task:  # (a backward that raised never ran its callback)
            self.task = task
            Variable._execution_engine.queue_callback(self.drain)

    def drain(self) -> None:
        self.task = None
        with self.failures.guard("the reductions of a backward"):
            self.pipeline.drain()


def attach(module: Any, group: Any, attr: str, comm: Any, setter: str) -> None:
    """`group`'s FSDP2 slot `attr` (e.g. "_all_gather_comm") set to `comm`: by the
    module's public `setter` when it has one group, else directly (the note)."""
    if len(module._get_fsdp_state()._fsdp_param_groups) == 1:
        getattr(module, setter)(comm)
        return
    check_setter(setter, attr)
    setattr(group, attr, comm)


def check_setter(setter: str, attr: str) -> None:
    """That FSDP2's `setter` writes each parameter group's `attr` (the note), from its
    source; refused in one line, naming the torch version, when it does not."""
    from torch.distributed.fsdp import FSDPModule
    try:
        ok = f"fsdp_param_group.{attr} = " in inspect.getsource(getattr(FSDPModule, setter))
    except (AttributeError, OSError, TypeError):  # no such setter, or no source
        ok = False
    if not ok:
        raise NotImplementedError(
            f"zeropp.fsdp2: a module with several FSDP parameter groups (per-parameter "
            f"meshes, e.g. MoE experts) needs FSDP2's {setter} to set each group's {attr}, as "
            f"torch 2.13's does; torch {torch.__version__}'s does not: shard the experts in a "
            "module of their own (fully_shard on it before its block)")
