"""deferred_init(): build a model larger than one process can hold, exactly as it would be
built whole, and let `shard` materialize one unit at a time.

[Note: recorded initialization]
Inside the context constructors run on the CPU as usual, but in-place writes to a registered
parameter (what `torch.nn.init`, `reset_parameters` and Hugging Face's `_init_weights` do:
normal_, uniform_, fill_, zero_, mul_, ...) are recorded instead of run. The parameter's
storage is allocated, never written, so the kernel maps no pages for it: a model of any size
costs its buffers and small tensors only.
Exactness: an op that draws random numbers runs once at record time on a scratch tensor of its
geometry (freed at once), so the generator advances as in the whole build and every later draw
(other parameters, buffers, user code after the context) sees the same stream; the generator's
state before the op is kept with it. `materialize(p)` replays p's ops from the last one that
overwrote it whole, each from its saved state in a generator of its own (no other draw moves
or sees it): bit-identical to the model built without the context under the same seed, in any
order, on any thread and rank. A parameter replaced (`p.data = ...`, `model.to()`) or written
in place after the context cannot be replayed: `materialize` says so.
An op that reads a parameter inside the build (not a view; e.g. an init looking at values it
drew) first gets that parameter's values in its own storage: exact, only that memory is spent
early. torch.nn.init's functions are recorded whole (their result depends on the shape and the
generator only), so trunc_normal_'s rejection sampling stays deferred.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_pre_hook,
    register_module_parameter_registration_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from .host_memory import release_freed_host_memory

# Ops whose result does not depend on what the tensor held: a whole-tensor one makes every
# earlier op on the parameter dead (its draws were already made).
_OVERWRITES = {"normal_", "uniform_", "fill_", "zero_", "random_", "bernoulli_",
               "exponential_", "geometric_", "log_normal_", "cauchy_", "copy_"}

# torch.nn.init's functions: each overwrites the whole tensor from the generator alone.
_INIT_FUNCTIONS = """uniform_ normal_ trunc_normal_ constant_ ones_ zeros_ eye_ dirac_ sparse_
    xavier_uniform_ xavier_normal_ kaiming_uniform_ kaiming_normal_ orthogonal_""".split()


@dataclass
class _Op:
    func: Any                          # an aten OpOverload or a torch.nn.init function
    geometry: tuple                    # (offset in the parameter, size, stride)
    args: tuple
    kwargs: dict
    rng_state: Optional[torch.Tensor] = None     # an op that draws: its generator's state before
    overwrites: bool = False           # whole parameter, independent of its contents


@dataclass
class _Record:
    ptr: int                           # the storage the parameter was built on
    offset: int                        # its storage offset
    ops: list = field(default_factory=list)
    version: int = -1                  # p._version when the context closed
    name: str = ""                     # module class and attribute, for messages


# id(parameter) -> (weak reference, its record): tensors compare elementwise (no WeakKeyDictionary)
_DEFERRED: dict[int, tuple[weakref.ref, _Record]] = {}


def _lookup(table: dict, p: Any) -> Any:
    return entry[1] if (entry := table.get(id(p))) is not None and entry[0]() is p else None


def _keep(table: dict, p: nn.Parameter, value: Any) -> None:
    key = id(p)
    table[key] = (weakref.ref(p, lambda _r: table.pop(key, None)), value)


def is_deferred(p: torch.Tensor) -> bool:
    """Whether `p` was built under deferred_init() and not materialized yet."""
    return _lookup(_DEFERRED, p) is not None


def _draws(func: Any) -> bool:
    return any("Generator" in str(a.type) for a in func._schema.arguments)


def _writes_first_arg(func: Any) -> bool:
    return bool(a := func._schema.arguments) and getattr(a[0].alias_info, "is_write", False)


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.by_ptr: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.thread = threading.get_ident()  # what other threads build is theirs
        self.handle: Any = None  # its parameter-registration hook (deferred_init's)

    def register(self, module: nn.Module, name: str, p: Optional[nn.Parameter]) -> None:
        # Built as usual: a lazy parameter (LazyLinear's: no shape until its first forward), and
        # one on a part of a storage (chunks of one tensor), as ops are traced by storage.
        if (p is None or nn.parameter.is_lazy(p) or p.device.type != "cpu" or p.numel() == 0
                or p.untyped_storage().nbytes() != p.nbytes or is_deferred(p)
                or threading.get_ident() != self.thread):
            return
        ptr = p.untyped_storage().data_ptr()
        _keep(_DEFERRED, p, _Record(ptr, p.storage_offset(),
                                    name=f"{type(module).__name__}.{name}"))
        self.by_ptr[ptr] = p

    def _param_of(self, t: Any) -> Optional[nn.Parameter]:
        p = (self.by_ptr.get(t.untyped_storage().data_ptr())
             if isinstance(t, torch.Tensor) and t.device.type == "cpu" else None)
        return p if is_deferred(p) else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        p = self._param_of(args[0]) if args and _writes_first_arg(func) else None
        if not func.is_view:  # an op that reads a deferred parameter needs its values
            for t in tree_flatten((args[1:] if p is not None else args, kwargs))[0]:
                if (q := self._param_of(t)) is not None:
                    self.realize(q)
        if p is None or not is_deferred(p):  # (realized just now: the op reads p elsewhere)
            return func(*args, **kwargs)
        t = args[0]
        # Tensor arguments are copied: the op must see them as they are now.
        args, kwargs = tree_map(lambda a: a.detach().clone() if isinstance(a, torch.Tensor)
                                else a, (args[1:], kwargs))
        gen = (kwargs.get("generator") or torch.default_generator) if _draws(func) else None
        self.record(p, t, func, args, kwargs, func._schema.name.split("::")[-1] in _OVERWRITES, gen)
        return t

    def record(self, p: nn.Parameter, t: torch.Tensor, func: Any, args: tuple, kwargs: dict,
               overwrites: bool, generator: Optional[torch.Generator]) -> None:
        """Record `func` on `t`, a view of `p`; `generator`: the one it draws from, if any."""
        rec = _lookup(_DEFERRED, p)
        geometry = (t.storage_offset() - rec.offset, tuple(t.size()), tuple(t.stride()))
        op = _Op(func, geometry, args, kwargs, overwrites=overwrites and geometry[0] == 0
                 and t.numel() == p.numel() and t.is_contiguous())
        if generator is not None:
            op.rng_state = generator.get_state()
            # Advance the generator as the real op does, on a scratch tensor freed at once.
            func(torch.empty_strided(t.size(), t.stride(), dtype=t.dtype), *args, **kwargs)
        if op.overwrites:  # earlier ops are dead: their draws are made, their values lost
            rec.ops.clear()
        rec.ops.append(op)

    def realize(self, p: nn.Parameter) -> None:
        """Something reads `p` inside the build: give it its values now (see the note)."""
        rec = _lookup(_DEFERRED, p)
        value = _replay(p, rec)  # first: a replay that raises leaves `p` deferred
        del _DEFERRED[id(p)], self.by_ptr[rec.ptr]
        p.detach().copy_(value)


@contextlib.contextmanager
def deferred_init() -> Iterator[None]:
    """Build a model inside this context to shard it without ever holding it whole:

        torch.manual_seed(0)
        with zeropp.deferred_init():
            model = Transformer(cfg)        # parameters allocated, not written
        zeropp.shard(model, cfg)            # each rank materializes one unit at a time

    The shards equal, bit for bit, those of the model built without the context under the
    same seed (see the note). Until sharded (or passed to `materialize_module`) its parameters
    hold no values: do not run it. Buffers and other non-parameter tensors are built as usual."""
    rec = _Recorder()
    rec.handle = register_module_parameter_registration_hook(rec.register)
    try:
        with _recording(rec):
            yield
    finally:
        rec.handle.remove()
        _close(rec)


_OPEN: list = []  # the recorders open now, innermost last
_TORCH_INIT: dict[str, Callable] = {}  # torch.nn.init's own functions while ours stand in
_LOCAL = threading.local()  # .hidden: the recorders this thread's paused() hides
_LOCK = threading.Lock()  # over _OPEN and _TORCH_INIT: builds in several threads


def _recorders() -> list:
    """The recorders of this thread that record now, innermost first."""
    hidden = getattr(_LOCAL, "hidden", ())
    return [r for r in reversed(_OPEN) if r.thread == threading.get_ident() and r not in hidden]


@contextlib.contextmanager
def _recording(rec: _Recorder) -> Iterator[None]:
    release_freed_host_memory()  # freed scratch chunks must not be reused as parameters
    with _LOCK:
        if not _OPEN:  # the first recorder open: torch.nn.init's functions are recorded
            _TORCH_INIT.update({name: getattr(nn.init, name) for name in _INIT_FUNCTIONS})
            vars(nn.init).update({name: _recorded_init(fn) for name, fn in _TORCH_INIT.items()})
        _OPEN.append(rec)
    try:
        with rec:
            yield
    finally:
        with _LOCK:
            _OPEN.remove(rec)
            if not _OPEN:
                vars(nn.init).update(_TORCH_INIT)
                _TORCH_INIT.clear()


def _recorded_init(fn: Callable) -> Callable:
    """torch.nn.init's `fn` while a deferred_init() is open: one recorded op on a deferred
    parameter of this thread's contexts (see the note); anything else gets torch's own."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def init(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        for rec in _recorders():
            p = rec._param_of(tensor)
            if p is not None:
                gen = sig.bind(tensor, *args, **kwargs).arguments.get("generator")
                rec.record(p, tensor, fn, args, dict(kwargs), True, gen or torch.default_generator)
                return tensor
        return fn(tensor, *args, **kwargs)
    return init


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Run the body as if no deferred_init() context were open: `shard` (or DeepSpeed's
    `initialize`) called inside `with zero.Init():` materializes the model as built so far,
    and its own tensors and parameters are not recorded."""
    mine = [rec for rec in list(_OPEN) if rec.thread == threading.get_ident()]
    if not mine:  # (other threads' recorders record nothing of this one)
        yield
        return
    opened = [rec for rec in mine if rec.handle is not None]
    for rec in opened:
        _snapshot(rec)
        rec.handle.remove()
    hidden, _LOCAL.hidden = getattr(_LOCAL, "hidden", ()), tuple(mine)
    try:
        with _disable_current_modes():
            yield
    finally:
        _LOCAL.hidden = hidden
        for rec in opened:
            rec.handle = register_module_parameter_registration_hook(rec.register)


def _snapshot(rec: _Recorder) -> None:
    """The build so far is the build: versions as they are now (as at the close)."""
    for p in filter(is_deferred, list(rec.by_ptr.values())):
        _lookup(_DEFERRED, p).version = p._version


def _close(rec: _Recorder) -> None:
    """The build is over: versions must not move; modules with unwritten parameters may not run."""
    global _guard
    _snapshot(rec)
    if _DEFERRED and _guard is None:
        _guard = register_module_forward_pre_hook(_refuse_unmaterialized)
        nn.Parameter.__deepcopy__ = _deepcopy  # torch's would copy unwritten memory


_guard: Any = None  # the global forward pre-hook and deepcopy, while deferred parameters exist
_TORCH_DEEPCOPY = nn.Parameter.__deepcopy__


def _refuse_unmaterialized(module: nn.Module, args: Any) -> None:
    global _guard
    if not _DEFERRED and _guard is not None:  # everything was sharded or materialized: stop
        _guard.remove()
        _guard, nn.Parameter.__deepcopy__ = None, _TORCH_DEEPCOPY
    for name, p in module._parameters.items():
        if p is not None and is_deferred(p):
            raise RuntimeError(
                f"zeropp.deferred_init: {type(module).__name__}.{name} has no values yet; "
                "shard the model (zeropp.shard / zeropp.initialize) or call "
                "zeropp.deferred.materialize_module(model) before running it")


# id(parameter) -> (weak reference, its tensor): parameters showing 0 elements (zero.Init's)
_HIDDEN: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def hide(p: nn.Parameter) -> None:
    """`p` shows 0 elements (`p.data` empty) until `show(p)`; its tensor is kept aside unchanged
    (same storage and version: a deferred one still materializes exactly)."""
    if not is_hidden(p) and p.numel():
        _keep(_HIDDEN, p, p.data)
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def is_hidden(p: Any) -> bool:
    return _lookup(_HIDDEN, p) is not None


def show(p: nn.Parameter) -> None:
    """Undo `hide(p)`."""
    if is_hidden(p):
        p.data = _HIDDEN.pop(id(p))[1]


def _deepcopy(p: nn.Parameter, memo: dict) -> Any:
    """copy.deepcopy of a parameter: a deferred one's copy is deferred, with its ops."""
    rec = _lookup(_DEFERRED, p)
    if rec is None or rec.version == -1 or is_hidden(p):  # (inside a build torch's reads p)
        return _TORCH_DEEPCOPY(p, memo)
    q = nn.Parameter(torch.empty_strided(p.size(), p.stride(), dtype=p.dtype), p.requires_grad)
    if not (rec.ops and rec.ops[0].overwrites):  # its ops edit its values (as in _replay)
        q.data.copy_(p.detach())
    moved = p.untyped_storage().data_ptr() != rec.ptr or p._version != rec.version
    _keep(_DEFERRED, q, replace(rec, ptr=q.untyped_storage().data_ptr(), offset=0, ops=[*rec.ops],
                                version=q._version + moved))  # moved: materialize(q) refuses too
    return q


def show_module(model: nn.Module) -> None:
    """Show every hidden parameter of `model` (before sharding), then run each distinct
    `_zeropp_before_shard(model)` its parameters carry (zero.Init's: partitioned -> deferred)."""
    for p in model.parameters():
        show(p)
    hooks = (getattr(p, "_zeropp_before_shard", None) for p in model.parameters())
    for hook in dict.fromkeys(h for h in hooks if h is not None):
        hook(model)


def materialize(p: nn.Parameter) -> torch.Tensor:
    """The values of a parameter built under deferred_init(), in a new tensor of its shape and
    dtype; the parameter stays unwritten. A parameter not deferred is returned as it is."""
    rec = _lookup(_DEFERRED, p)
    if rec is None:
        return p.detach()
    t = _HIDDEN[id(p)][1] if is_hidden(p) else p  # the tensor it stands for
    moved = rec.version != -1 and p._version != rec.version  # -1: still being built
    if t.untyped_storage().data_ptr() != rec.ptr or moved:
        raise RuntimeError(
            f"zeropp.deferred_init: parameter {rec.name} {tuple(p.shape)} was replaced or "
            "written after the model was built (e.g. model.to(), p.data = ..., an in-place "
            "op); its values cannot be reproduced. Shard the model first, then change it")
    return _replay(t, rec)


def _replay(p: torch.Tensor, rec: _Record) -> torch.Tensor:
    out = torch.empty_strided(p.size(), p.stride(), dtype=p.dtype)
    if not (rec.ops and rec.ops[0].overwrites):  # built from values (torch.ones...), then edited
        out.copy_(p.detach())
    with torch.no_grad():
        for op in rec.ops:  # (geometry: offset, size, stride)
            with _Draws(op.rng_state) if op.rng_state is not None else contextlib.nullcontext():
                op.func(out.as_strided(*op.geometry[1:], op.geometry[0]), *op.args, **op.kwargs)
    return out


class _Draws(TorchDispatchMode):
    """A replayed op's draws: from a generator of its own at the op's saved state (the note)."""

    def __init__(self, state: torch.Tensor) -> None:
        super().__init__()
        self.generator = torch.Generator().set_state(state)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {**(kwargs or {}), "generator": self.generator} if _draws(func) else kwargs or {}
        return func(*args, **kwargs)


def defer(p: nn.Parameter, fill: Callable[[torch.Tensor], Any], name: str = "") -> None:
    """`p` (its shape on storage never written) becomes deferred with one op, `fill(out)`, that
    writes all its values: a parameter whose values are elsewhere (the DeepSpeed alias's
    partitions) is then sharded like a deferred_init() one, a unit at a time, in model order."""
    op = _Op(fill, (0, tuple(p.shape), tuple(p.stride())), (), {}, overwrites=True)
    _keep(_DEFERRED, p, _Record(p.untyped_storage().data_ptr(), p.storage_offset(), [op],
                                p._version, name))


def materialize_module(model: nn.Module) -> nn.Module:
    """Give every deferred parameter of `model` its values in place (the whole model, in this
    process): the unsharded model deferred_init() stood for."""
    for p in model.parameters():
        show(p)
        if is_deferred(p):
            p.data = materialize(p)
            _DEFERRED.pop(id(p))
    return model


def release(p: nn.Parameter) -> None:
    """Forget a deferred parameter once sharded: its unwritten storage goes back."""
    if is_deferred(p):
        _DEFERRED.pop(id(p))
        p.data = torch.empty(0, dtype=p.dtype)


def defer_meta(model: nn.Module) -> None:
    """Give each meta parameter of `model` an unwritten CPU storage and record its module's
    `reset_parameters()` (FSDP's rule for meta modules), module by module in registration
    order, so `shard` materializes it one unit at a time like a deferred_init() model. Exact
    (under the same seed) when the model's init is its modules' reset_parameters in that order
    (torch's layers); a meta tensor whose module has no reset_parameters is refused by name."""
    rec = _Recorder()
    replaced: dict[int, nn.Parameter] = {}
    with _recording(rec):
        for name, mod in model.named_modules():
            metas = [(n, p) for n, p in mod._parameters.items() if p is not None and p.is_meta]
            bufs = [n for n, b in mod._buffers.items() if b is not None and b.is_meta]
            fresh = [n for n, p in metas if id(p) not in replaced]  # not shared with one seen
            if (fresh or bufs) and not callable(getattr(mod, "reset_parameters", None)):
                what = ", ".join(f"{name or '<root>'}.{n}" for n in [*fresh, *bufs])
                raise ValueError(
                    f"zeropp.shard: {what} ({type(mod).__name__}) is on the meta device and "
                    "its module has no reset_parameters() to initialize it; build the model "
                    "under zeropp.deferred_init() instead (exact for any init)")
            for n, p in metas:
                if id(p) not in replaced:
                    q = replaced[id(p)] = nn.Parameter(torch.empty_like(p, device="cpu"))
                    rec.register(mod, n, q.requires_grad_(p.requires_grad))
                mod._parameters[n] = replaced[id(p)]
            for n in bufs:
                mod._buffers[n] = torch.zeros(mod._buffers[n].shape, dtype=mod._buffers[n].dtype)
            if fresh or bufs:
                mod.reset_parameters()
    _close(rec)
