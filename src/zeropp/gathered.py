"""zeropp.gathered(model): full weights resident for a while, gathered once.

Generation under ZeRO-3 re-gathers every unit for every token: an RLHF actor generating 100
tokens moves its weights 100 times. Inside `gathered()` the units stay gathered, so forwards
issue no collective; the gather on entry is a training forward's (hpZ's secondary inside the
node when current, else qwZ's INT8 or qWD's copies), so the weights are bit for bit those training
uses (`writable`: unquantized). Models: `summon_full_params` and DeepSpeed's `GatheredParameters`.

[Note: writing back]
With `writable=True` every gathered flat buffer is also kept as gathered (a snapshot); on a
normal exit each rank compares its own shard's slice of the (possibly edited) full weights with
the snapshot, bit for bit, and writes the elements that differ into its fp32 master shard.
Under qwZ the buffers are first gathered again unquantized (counted, `all_gather/gathered`):
compared with qwZ's rounding, an edit that wrote what the rounding showed (zeroing a weight
shown as 0) was lost. With `modifier_rank=r`, rank r's edits count: it first
scatters each rank's slice of its full weights (DeepSpeed's GatheredParameters semantics);
otherwise every rank must make the same edits (PyTorch's writeback semantics). Then every rank
drops its hpZ secondaries / qWD copies of those units, edited or not, so routes stay identical
on every rank and the next forward gathers in full. An exception on any rank discards every
rank's edits (the ranks agree by one all-reduce on exit): the master shards are untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Optional, Union

import torch
from torch import nn

from . import master_shard
from .config import _is_int
from .flat_param import FlatParam
from .guards import first_failure, in_one_line
from .shard import ShardState, get_state
from .unit_hooks import Unit, _in_backward


@contextlib.contextmanager
def gathered(model: nn.Module, *, writable: bool = False,
             units: Optional[Iterable[Union[str, nn.Module]]] = None,
             max_bytes: Optional[int] = None,
             modifier_rank: Optional[int] = None) -> Iterator[nn.Module]:
    """Gather the units of a sharded `model` once and keep them resident; yields the model.

    Inside, forwards of the gathered units issue no collective (generation: one gather per
    rollout, not per token), under grad, `no_grad` or `inference_mode`, with HF `generate()` and
    its KV cache; module attributes (`model.lm_head.weight`, ...) are the full weights. Call it
    on every rank with the same arguments (it gathers). Nesting is harmless. Backward and
    optimizer steps inside raise (the gathered weights would go stale): train after the context.

    `units`: which units to keep (names as in `model._zeropp_state.units`, "" or "<root>" for
    the root, or the unit modules); the others are gathered per forward as in training, so every
    rank must then run the same number of forwards (HF `generate`: pass `synced_gpus=True` if
    ranks may stop at different lengths). `max_bytes`: keep units, in model order, while their
    full weights (compute dtype; twice that with `writable`) fit, held for the context. What to
    pick: everything (the default) when the full model fits beside the activations and KV cache;
    else as many units as fit: each saves its whole size per token, so which ones matters little.
    Keeping units matters most without hpZ (a per-token gather then crosses nodes).

    `writable=True`: edits made inside are written into the master shards on exit (the note),
    for a snapshot of every kept unit, an unquantized gather of them on entry (qwZ) and a full
    (non-hpZ) one at exit. `modifier_rank`: with `writable`, the rank whose edits are kept.
    """
    st = _state(model)
    if _in_backward():
        raise RuntimeError("zeropp.gathered: called while a backward is in flight; enter it "
                           "before the forward or after backward() returns")
    if modifier_rank is not None:
        if not writable:
            raise ValueError("zeropp.gathered: modifier_rank needs writable=True")
        if not (_is_int(modifier_rank) and 0 <= modifier_rank < st.topo.world_size):
            raise ValueError(f"zeropp.gathered: modifier_rank={modifier_rank!r} is not a rank "
                             f"of this world (0..{st.topo.world_size - 1})")
    chosen = _select(st, units, max_bytes, writable)
    if not st.gathered_depth:
        # As a training forward does: leftovers of an interrupted forward or backward
        # (weights gathered before the last optimizer step) are dropped first.
        st.begin_iteration()
    snapshots, pinned = {}, []  # (writable) flat -> its weights at entry; units pinned so far
    try:
        # Issue every gather, then wait: the same collectives in the same (model) order on every
        # rank, all in flight together.
        with torch.inference_mode(False), torch.no_grad():
            for u in chosen:
                u.issue_gather()
            for u in chosen:
                u.wait()
            if writable:  # qwZ's rounding is not what edits are compared with (the note)
                for f in [f for u in chosen for f in u.flats if st.cfg.quantized_weights
                          and not f.int_storage]:
                    st.comm.all_gather(f.full, f.primary_shard.detach().to(f.full.dtype),
                                       op="all_gather/gathered").wait()
                snapshots = {f: f.full.clone() for u in chosen for f in u.flats}
            for u in chosen:
                u.pins += 1
                pinned.append(u)
                for f in u.flats:
                    f.install_attributes()  # module attributes read the gathered weights
    except BaseException:
        _release(pinned, chosen)  # e.g. out of memory for the snapshot: nothing stays pinned
        raise
    st.gathered_depth += 1
    st.snapshots.append(snapshots)
    error, peer_error = None, ""  # this rank's exception inside the context, in one line; a peer's
    try:
        yield model
    except BaseException as e:
        error = in_one_line(e)
        raise
    finally:
        st.gathered_depth -= 1
        st.snapshots = [s for s in st.snapshots if s is not snapshots]
        try:
            if writable:
                # All ranks write back or none, and all drop these units' secondaries (the
                # note); one that left normally raises its peer's error rather than wait alone.
                if _all_ok(st, error is None):
                    _write_back(st, snapshots, modifier_rank)
                else:
                    peer_error = first_failure(error, "zeropp.gathered")
                for f in snapshots:
                    f.buffer.invalidate()
        finally:
            snapshots.clear()
            _release(pinned, chosen)
            if writable:  # edited or not, as the secondaries; an outer context's too
                st.regather_resident(flats := [f for u in chosen for f in u.flats])
                for outer in st.snapshots:  # what it compares with (qwZ's rounding is no edit)
                    outer.update({f: f.full.clone() for f in flats if f in outer})
    if peer_error and error is None:
        raise RuntimeError(f"zeropp.gathered: {peer_error} inside the context; every rank's "
                           "edits were discarded")


def _release(pinned: list[Unit], chosen: list[Unit]) -> None:
    for u in pinned:
        u.pins -= 1
    for u in chosen:
        # No-op while an outer context holds it. A tensor taken inside (`p.detach()`, keep_vars
        # state dicts) keeps its values: the buffer is let go of, as GatheredParameters does.
        u.free(let_go=True)


def _all_ok(st: ShardState, ok: bool) -> bool:
    """Collective: whether every rank left the context normally."""
    flag = torch.tensor([1.0 if ok else 0.0], device=st.flats[0].full.device)
    st.comm.unit = "<all: gathered exit>"
    return bool(st.comm.all_reduce(flag, op="all_reduce/gathered",
                                   reduce_op=torch.distributed.ReduceOp.MIN)[0] == 1.0)


def _state(model: nn.Module) -> ShardState:
    try:
        return get_state(model)
    except ValueError:
        if hasattr(model, "_zeropp_unit"):
            raise ValueError("zeropp.gathered: this is a unit of a sharded model; pass the "
                             "root model (select units with units=...)") from None
        raise ValueError("zeropp.gathered: this model was not sharded with zeropp.shard(); "
                         "call zeropp.shard(model, cfg) first (a plain model needs no "
                         "gathering)") from None


def _select(st: ShardState, units, max_bytes: Optional[int], writable: bool) -> list[Unit]:
    by_name = {u.name: u for u in st.units} | {"<root>": st.units[0]}
    picked = set()
    for x in [units] if isinstance(units, (str, nn.Module)) else units or ():
        u = (by_name.get(x) if isinstance(x, str)
             else getattr(x, "_zeropp_unit", None) if isinstance(x, nn.Module) else None)
        if u is None or u.state is not st:
            names = ", ".join(repr(u.label) for u in st.units)
            raise ValueError(f"zeropp.gathered: {x!r} is not a unit of this model; its "
                             f"units are {names}")
        picked.add(u)
    chosen = [u for u in st.units if units is None or u in picked]  # model order
    if max_bytes is not None:
        if not (_is_int(max_bytes) and max_bytes >= 0):
            raise ValueError(f"zeropp.gathered: max_bytes={max_bytes!r} must be an int >= 0")
        kept, total = [], 0
        for u in chosen:  # a writable context also holds a snapshot of each
            size = sum(f.padded_numel * f.full.element_size() for f in u.flats) * (1 + writable)
            if total + size <= max_bytes:
                kept.append(u)
                total += size
        chosen = kept
    return chosen


def _write_back(st: ShardState, snapshots: dict[FlatParam, torch.Tensor],
                modifier_rank: Optional[int]) -> None:
    with torch.inference_mode(False), torch.no_grad():
        for f, before in snapshots.items():
            lo = st.topo.rank * f.shard_numel
            if modifier_rank is None:
                mine = f.full[lo:lo + f.shard_numel]
            else:
                mine = st.comm.scatter(f.full.view(f.world_size, -1), src=modifier_rank,
                                       op="scatter/gathered")
            changed = _bits(mine) != _bits(before[lo:lo + f.shard_numel])
            changed[f.shard_valid:] = False  # padding stays zero
            if changed.any():
                master_shard.write_shard(f, mine, changed)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of `t`: a bitwise comparison (NaN == NaN, -0.0 != 0.0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
                  [t.element_size()])
