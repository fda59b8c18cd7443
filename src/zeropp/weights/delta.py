"""qWD: secondaries kept across optimizer steps. After a step each owner sends a
delta of its primary shard to the holders of copies of it (its inter-node
group); every holder, the owner too, applies it to its copy, bit for bit the
same everywhere; then the gather inside the node (hpz.issue_inner).

[Note: qWD's copies]
With `weight_copy_bits=8` (the default) the copies are qwZ's INT8 blocks of the
masters, the bytes the node gathers for every forward and backward, as ZeRO++'s
INT8 secondary; the delta moves their integer codes (qwd.py: the copy becomes
qwZ's INT8 of the new master, exactly whenever no code moved by more than 7).
With `weight_copy_bits=None` they are exact, at the compute dtype: the owner
sends q(master - its copy), every holder adds dequant of it, and the rounding
error stays in master - copy, sent with the next delta instead of lost.
The route depends only on state every rank shares (version counters, steps),
so every rank issues the same collectives in the same order on each group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import qwd
from ..collectives import Comm, Pending
from ..quant import QTensor, dequantize, quantize, scratch_buffer
from . import hpz

if TYPE_CHECKING:
    from . import WeightPath


def issue(path: WeightPath, comm: Comm, op: str) -> Pending:
    """Stage 1: every owner sends a delta of its shard to the shard's holders (the
    inter-node group); each applies it to its copy. Stage 2, when stage 1 is
    waited for: the gather of the copies inside the node (hpz.issue_inner)."""
    if path.stochastic and path.generator is None:
        path.generator = torch.Generator(device=path.flat.full.device).manual_seed(path.seed)
    n = path.flat.world_size // path.p
    encode = code_delta if path.copy_bits is not None else value_delta
    send, apply, meta_bytes = encode(path, path.secondary.view(n, -1))
    out = torch.empty(n * send.numel(), dtype=torch.uint8, device=send.device)
    # Until `then` has run, the copies are mid-update (the owner's piece holds its
    # delta already): if the collective fails, the next gather refreshes in full,
    # rebuilding every holder's copies from the masters, rather than resending.
    version, path.stepped_at = path.stepped_at, None

    def then() -> None:
        for k, piece in enumerate(out.view(n, -1)):
            if k != path.outer_index:  # the owner's own piece moved at the encode
                apply(k, piece)        # the same ops on every holder
        path.current_for, path.stepped_at = version, None
        path.deltas += 1
        hpz.issue_inner(path, comm, path.secondary, f"{op}/hpz", "hpz", path.copy_bits).wait()
    return comm.all_gather(out, send, op=f"{op}/delta", group="inter_node",
                           scale_bytes=n * meta_bytes, then=then)


def value_delta(path: WeightPath, copies: torch.Tensor):
    """Exact copies: the owner sends q(master - its copy) and adds what every holder
    will decode (the encode's `dequantized`, bit for bit) instead of unpacking its
    own bytes. Returns (bytes to send, apply(k, piece), non-code bytes per piece)."""
    f = path.flat
    numel = f.shard_numel
    diff = torch.sub(f.primary_shard.detach().float(), copies[path.outer_index].float(),
                     out=scratch_buffer("delta", numel, copies.device))
    own = scratch_buffer("delta_own", numel, copies.device)
    send = quantize(diff, path.delta_bits, f.block, stochastic=path.stochastic,
                    generator=path.generator, dequantized=own).to_bytes()
    copies[path.outer_index].add_(own)

    def apply(k: int, piece: torch.Tensor) -> None:
        q = QTensor.from_bytes(piece, (numel,), torch.float32, path.delta_bits, f.block)
        copies[k].add_(dequantize(q, out=scratch_buffer("delta_part", numel, piece.device)))
    return send, apply, numel // f.block * 4


def code_delta(path: WeightPath, copies: torch.Tensor):
    """INT8 copies: the owner moves its copy's codes to qwZ's INT8 of its master and
    sends how they moved (qwd.py); holders move theirs the same. Returns as above."""
    f = path.flat
    kw = dict(copy_bits=path.copy_bits, delta_bits=path.delta_bits, block=f.block)
    send = torch.empty(qwd.wire_bytes(f.shard_numel, **kw), dtype=torch.uint8,
                       device=copies.device)
    qwd.encode(f.primary_shard.detach(), copies[path.outer_index], send,
               stochastic=path.stochastic, generator=path.generator, **kw)

    def apply(k: int, piece: torch.Tensor) -> None:
        qwd.apply(copies[k], piece, numel=f.shard_numel, **kw)
    return send, apply, qwd.meta_bytes(f.shard_numel, f.block)
