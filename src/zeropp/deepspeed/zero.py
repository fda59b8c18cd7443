"""`zeropp.zero`: DeepSpeed's `deepspeed.zero` names that scripts use.

`GatheredParameters(params, modifier_rank=None)` is `zeropp.gathered()` on the
units holding `params`: inside, the module attributes are the full weights;
with `modifier_rank=r`, rank r's edits are written into every shard on exit
(DeepSpeed broadcasts rank r's full weights); without it, edits are discarded,
as in DeepSpeed. Parameters that zeropp does not shard make it a no-op, as
DeepSpeed does for non-ZeRO parameters. `Init()` is `zeropp.deferred_init()`
(a model built inside is materialized one unit at a time when it is sharded).
`ZeroParamStatus`: DeepSpeed's enum of a ZeRO-3 parameter's state; zeropp's
module attributes carry `ds_status` (AVAILABLE while their unit is gathered).
`unwrap_model_for_generation(engine)`: every unit gathered for the duration
(`zeropp.gathered`); zeropp's hooks do no collective then, so none is removed.
`MiCS_Init` is refused: MiCS is not part of zeropp.
`param.all_gather()` / `all_gather_coalesced(params)` / `partition()`: DeepSpeed's
per-parameter methods, on the model's own parameters under the engine: gather
the units holding them (until `partition()` or the next forward frees them).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch.nn.modules.module import register_module_parameter_registration_hook

from ..deferred import deferred_init, hide, is_deferred, is_hidden, materialize, release, show
from ..gathered import gathered
from ..guards import check_peers, first_failure, in_one_line
from .attributes import ZeroParamStatus, owner_of
from .hf_loader import install as install_lazy_hf_loads
from .partitioned import before_shard, is_partitioned, keep, own_chunk
from .partitioned import gather as gather_partitions
from .partitioned import partition as partition_param


def _unit_of(t: Any) -> Any:
    """The zeropp Unit a tensor belongs to: a master shard (what `parameters()`
    yields after sharding) or a module attribute (a view of a unit's weights)."""
    if not isinstance(t, torch.Tensor):
        return None
    for cand in (t, t._base):
        f = owner_of(cand) if cand is not None else None
        if f is not None:
            return f.unit
    return None


@contextlib.contextmanager
def GatheredParameters(params: Any, modifier_rank: Optional[int] = None, fwd_module: Any = None,
                       enabled: bool = True) -> Iterator[None]:
    """Gather the units of `params` (a tensor or an iterable of them) for the
    duration; see the module docstring. Call it on every rank."""
    if isinstance(params, torch.Tensor):
        params = [params]
    elif params is None:
        params = []
    else:
        try:
            params = list(params)
        except TypeError:
            params = [params]
    units = [u for u in map(_unit_of, params) if u is not None]
    # (one already AVAILABLE is an enclosing context's: left to it)
    unsharded = [p for p in params if (is_deferred(p) or is_hidden(p) or is_partitioned(p))
                 and getattr(p, "ds_status", None) is not ZeroParamStatus.AVAILABLE]
    if enabled and unsharded:  # built under Init, not sharded yet
        with _materialized(unsharded, modifier_rank):
            yield
        return
    if not enabled or not units:
        yield
        return
    by_state: dict[int, tuple[Any, list]] = {}
    for u in units:
        by_state.setdefault(id(u.state), (u.state, []))[1].append(u.module)
    with contextlib.ExitStack() as stack:
        for st, mods in by_state.values():
            stack.enter_context(gathered(st.root, units=mods, writable=modifier_rank is not None,
                                         modifier_rank=modifier_rank))
        yield


_EVERY_RANK = ("GatheredParameters is collective, and under ZeRO-3 so is transformers' "
               "from_pretrained: run it on every rank, or in a process without the "
               "DeepSpeed config")


@contextlib.contextmanager
def _materialized(params: list, modifier_rank: Optional[int]) -> Iterator[None]:
    """GatheredParameters on parameters built under Init before `initialize`: inside,
    their full values (a partitioned one all-gathered, a deferred one materialized:
    the whole build's, bit for bit), AVAILABLE; on exit each keeps its partition
    (partitioned.py): with `modifier_rank`, of that rank's values (scattered from it,
    as DeepSpeed broadcasts them), without, of its values before the context (edits
    discarded, as DeepSpeed's); then they show 0 elements again."""
    # a tied one once; in ds_id order, the same on every rank whatever order the caller's
    # (transformers passes a set of tensors, which each process iterates differently)
    params = sorted({id(p): p for p in params}.values(), key=lambda p: getattr(p, "ds_id", -1))
    # a rank alone here (from_pretrained called on one rank) is named before any tensor
    # of the context travels, rather than mismatched against another collective
    check_peers("GatheredParameters", _EVERY_RANK)
    before = []  # each one's partition now: what it keeps unless a rank modifies it
    with torch.no_grad():
        for p in params:
            if is_partitioned(p):
                before.append(p.ds_tensor)
                p.data = gather_partitions(p)
                continue
            show(p)
            if is_deferred(p):
                value = materialize(p)
                release(p)
                p.data = value
            before.append(own_chunk(p.data))
    for p in params:
        p.ds_status = ZeroParamStatus.AVAILABLE
    error: Optional[str] = None
    try:
        yield
    except BaseException as e:
        error = in_one_line(e)
        raise
    finally:
        for p in params:
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE
        failed = ""
        src = modifier_rank if torch.distributed.is_initialized() else None
        if modifier_rank is not None and torch.distributed.is_initialized():
            # Every rank scatters or none does: one rank's exception is every rank's.
            failed = first_failure(error, "GatheredParameters", _EVERY_RANK)
        with torch.no_grad():
            for p, old in zip(params, before):
                if modifier_rank is not None and not failed:
                    partition_param(p, p.data, src=src)
                else:
                    keep(p, old, torch.Size(getattr(p, "ds_shape", p.shape)))
        if failed and error is None:
            raise RuntimeError(f"zeropp GatheredParameters: {failed} inside the context")


class _Done:
    """DeepSpeed's all-gather handle: the gather has completed when it is returned."""

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass


def _units_in_order(params: Any) -> list:
    units = {u for u in map(_unit_of, params if params is not None else []) if u is not None}
    return [u for st in {id(u.state): u.state for u in units}.values()
            for u in st.units if u in units]  # model order: the same collectives everywhere


def all_gather_coalesced(params: Any, *args: Any, **kwargs: Any) -> _Done:
    """Gather the units holding `params` (collective: every rank, the same params):
    they stay gathered (AVAILABLE) until `partition()` or the next forward."""
    units = _units_in_order(list(params))
    with torch.no_grad():
        for u in units:
            u.issue_gather()
        for u in units:
            u.wait()
    return _Done()


def partition(params: Any) -> None:
    """Free the units holding `params` (not those an open GatheredParameters holds)."""
    for u in _units_in_order(list(params)):
        u.free(let_go=True)


def add_gather_methods(t: torch.Tensor) -> None:
    """DeepSpeed's per-parameter methods on a module attribute (`t.all_gather()`,
    `t.all_gather_coalesced(params)`, `t.partition()`)."""
    t.all_gather_coalesced = all_gather_coalesced
    t.all_gather = lambda param_list=None, *a, **k: all_gather_coalesced(
        param_list if param_list is not None else [t])
    t.partition = lambda param_list=None, *a, **k: partition(
        param_list if param_list is not None else [t])


@contextlib.contextmanager
def Init(*args: Any, enabled: bool = True, **kwargs: Any) -> Iterator[None]:
    """DeepSpeed's context for building a model that does not fit whole: here
    `zeropp.deferred_init()` (parameters recorded, not written; `initialize` or
    `zeropp.shard` materializes one unit at a time, values exactly as the whole
    build's under the same seed). DeepSpeed's other arguments (config, remote
    device, dtype) are accepted and unused. Hugging Face's from_pretrained and
    from_config then write the weights module by module inside
    GatheredParameters(modifier_rank=0), after which each parameter keeps only its
    partition (partitioned.py). An Init inside an open one (transformers' inside
    the user's) adds nothing: the outer one records. What other threads build meanwhile
    is theirs (deferred_init's rule): neither recorded, tagged nor hidden by this one."""
    if not enabled or getattr(_open_inits, "count", 0):
        yield
        return
    if not torch.distributed.is_initialized():  # as DeepSpeed's Init does
        from .comm import init_distributed
        init_distributed()
    install_lazy_hf_loads()  # transformers enters Init before its load (hf_loader.py)
    built: list = []
    me = threading.get_ident()
    with deferred_init():
        tagging = register_module_parameter_registration_hook(
            lambda m, n, p: _tag_deferred(p, built) if threading.get_ident() == me else None)
        _open_inits.count = 1
        try:
            yield
        finally:
            _open_inits.count = 0
            tagging.remove()
    for ref in built:  # DeepSpeed's partitioned look: 0 elements until gathered or sharded
        p = ref()
        if (p is not None and p.ds_status is ZeroParamStatus.NOT_AVAILABLE
                and owner_of(p) is None):  # (a master shard: sharded inside)
            hide(p)


_ids = itertools.count()
_open_inits = threading.local()  # .count: this thread's open Init (nested ones add nothing)


def _tag_deferred(p: Any, built: list) -> None:
    """A parameter built under Init carries DeepSpeed's ZeRO-3 attributes, as
    DeepSpeed's do from construction (libraries test `hasattr(p, "ds_id")`): it
    holds no values until `initialize` shards the model, and shows 0 elements
    (`ds_shape` its shape) once the block ends, except inside GatheredParameters. A lazy
    one (LazyLinear's) has no shape until its first forward: left as it is."""
    if p is not None and not hasattr(p, "ds_id") and not torch.nn.parameter.is_lazy(p):
        p.ds_id, p.ds_status = next(_ids), ZeroParamStatus.NOT_AVAILABLE
        p.ds_shape, p.ds_numel = p.shape, p.numel()
        p._zeropp_before_shard = before_shard  # (deferred.show_module)
        built.append(weakref.ref(p))


def MiCS_Init(*args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's MiCS partitioning: not part of zeropp (refused in one line)."""
    from ..guards import one_line
    raise one_line(NotImplementedError(
        "zeropp: deepspeed.zero.MiCS_Init (MiCS) is not supported; use deepspeed.zero.Init, "
        "and zero_hpz_partition_size for a node-local secondary partition"))


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """The model with every unit gathered for the duration (one gather per unit, not
    one per token); `model`: an engine or a sharded module. Call it on every rank."""
    module = getattr(model, "module", model)
    with gathered(module):
        yield model


def register_external_parameter(module: Any, parameter: Any) -> None:
    """DeepSpeed needs to be told of a parameter a module's forward uses but does not
    own. zeropp gathers whole units (a transformer block, the root with everything
    else), so a parameter used inside its own unit needs nothing: accepted."""


def unregister_external_parameter(module: Any, parameter: Any) -> None:
    """See register_external_parameter."""
