"""Parameters partitioned before sharding: a model loaded under zero.Init holds no
parameter whole between its load and `initialize`.

Hugging Face's `from_pretrained` under ZeRO-3 builds the model inside zero.Init
and then writes each module's weights inside `GatheredParameters(params,
modifier_rank=0)` on rank 0 (its `_load_state_dict_into_zero3_model`; missing
weights and `from_config`'s init the same way). When such a context closes, each
of its parameters keeps only its partition: chunk r of its flat values in W
equal chunks (the last padded with zeros), scattered from the modifier rank,
which is DeepSpeed's own per-parameter layout and its `ds_tensor`; the parameter
shows 0 elements. So the largest a rank holds during the load is its partitions
plus the module being written (and rank 0 the checkpoint transformers reads).
A later GatheredParameters all-gathers the partitions. The partitions stay where the
model is built (the host); each collective runs on the group's device (NCCL's: the
GPU), so one path serves every backend. Before sharding
(`initialize`, or `zeropp.shard`: deferred.show_module's hook), each partitioned
parameter becomes a deferred one whose one op is that all-gather (`to_deferred`), so
`shard` gathers each once, in model order on every rank, into the unit it joins,
whose shard it then keeps.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ..collectives import _all_gather_flat, collective_device
from ..deferred import defer

# id(parameter) -> (weak reference, its partition): tensors compare elementwise.
_PARTS: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def is_partitioned(p) -> bool:
    entry = _PARTS.get(id(p))
    return entry is not None and entry[0]() is p


def own_chunk(full: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of `full`'s flat values (W equal chunks, zero-padded), a copy."""
    w, r = _world()
    c = -(-full.numel() // w)
    chunk = torch.zeros(c, dtype=full.dtype, device=full.device)
    mine = full.detach().reshape(-1)[r * c:(r + 1) * c]
    chunk[:mine.numel()] = mine
    return chunk


def partition(p: torch.nn.Parameter, full: torch.Tensor, src: int | None = None) -> None:
    """`p` keeps chunk r of `full` (of rank `src`'s `full` when given: scattered from
    it, a collective) and shows 0 elements; `p.ds_shape` is its shape."""
    w, r = _world()
    if src is None or w == 1:
        chunk = own_chunk(full)
    else:
        n, dev = full.numel(), collective_device()
        chunk = torch.empty(-(-n // w), dtype=full.dtype, device=dev)
        parts = None
        if r == src:
            flat = full.detach().reshape(-1).to(dev)
            if n != w * chunk.numel():  # padded: a copy (only then, the module's largest)
                flat = torch.cat([flat, flat.new_zeros(w * chunk.numel() - n)])
            parts = list(flat.view(w, -1))
        dist.scatter(chunk, parts, src=src)
        chunk = chunk.to(full.device)
    keep(p, chunk, full.shape)


def keep(p: torch.nn.Parameter, chunk: torch.Tensor, shape: torch.Size) -> None:
    """`p` (of `shape`) holds `chunk` as its partition and shows 0 elements."""
    key = id(p)
    _PARTS[key] = (weakref.ref(p, lambda _r: _PARTS.pop(key, None)), chunk)
    p.ds_shape, p.ds_numel, p.ds_tensor = shape, shape.numel(), chunk
    p.data = torch.empty(0, dtype=chunk.dtype, device=chunk.device)


def gather(p: torch.nn.Parameter) -> torch.Tensor:
    """The full values of a partitioned `p`, in a new tensor of its shape (an
    all-gather of the partitions: every rank, the same parameters in the same order)."""
    return _all_gather(_PARTS[id(p)][1], p.ds_numel).view(p.ds_shape)


def _all_gather(chunk: torch.Tensor, numel: int) -> torch.Tensor:
    w, _ = _world()
    if w == 1:
        return chunk[:numel].clone()
    dev = collective_device()
    full = torch.empty(w * chunk.numel(), dtype=chunk.dtype, device=dev)
    _all_gather_flat(full, chunk.to(dev))
    return full[:numel].to(chunk.device)


def to_deferred(p: torch.nn.Parameter) -> None:
    """A partitioned `p` shows its shape again, on storage never written, and is deferred
    with the all-gather of its partitions as its one op (before `shard`)."""
    chunk, numel = _PARTS.pop(id(p))[1], p.ds_numel  # (the closure must not hold p)
    del p.ds_tensor
    p.data = torch.empty(p.ds_shape, dtype=chunk.dtype, device=chunk.device)

    defer(p, lambda out: out.copy_(_all_gather(chunk, numel).view(out.shape)),
          "a parameter partitioned under zero.Init")


def before_shard(model: torch.nn.Module) -> None:
    """Before `zeropp.shard` of a model built under zero.Init (each of whose parameters
    names this function: deferred.show_module): its partitioned parameters become
    deferred ones, and the shards get DeepSpeed's attributes as `initialize`'s do (a
    model sharded by `shard` alone carries none)."""
    from .attributes import HOOKS
    for p in model.parameters():
        if is_partitioned(p):
            to_deferred(p)
    model._zeropp_tensor_hooks = HOOKS
