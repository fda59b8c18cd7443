"""The compressed all-reduce zeropp.ft gives torchft, over any c10d process group.

[Note: both hops]
A quantized all-reduce over R replicas is a reduce-scatter then a gather. Hop 1:
each rank cuts its tensor into R chunks of whole blocks and sends chunk k,
quantized, to rank k (one all-to-all; the chunk a rank keeps is never
quantized); rank k sums what arrives in fp32, in rank order. Hop 2: rank k
quantizes its summed chunk once and every rank gathers those bytes and decodes
them, the owner included, so every replica holds the same bits.
At 4 bits and below both encodings carry error feedback (1-bit Adam's worker +
server residuals): each rank keeps what its hop-1 codes lost per peer, each
owner what its hop-2 code lost, and adds it to the next send of the same
tensor. Residuals are kept per tensor in call order within a round (torchft
starts one per quorum: every step, or every sync under DiLoCo) and dropped
when the membership changes, on every replica alike. A round meets the
residuals of the last round of the same `round_key()`: under Streaming DiLoCo
each fragment's sync is a quorum of its own, so the key is the fragment
(`CompressedGroup.follow_fragments`); else every round shares one. The result's
bits never depend on them being equal across replicas: everyone decodes the
same bytes.

A tensor whose exact ring all-reduce (in its own dtype) costs no more bytes than
the quantized one (small tensors: a chunk is at least one block per rank) goes exact.
Bytes per rank per all-reduce of P elements: 2 (R-1)/R P bits/8 plus one fp32
scale per block, against fp32's 2 (R-1)/R 4P: 1/16 of it at 2 bits.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions

from ..grads.qgz import HopCodec
from ..quant import QTensor, dequantize_pieces, quantize
from ..stats import CommStats, ring_send

CODECS = {"fp32": None, "int8": 8, "int4": 4, "2bit": 2}
GROUP = "replicas"   # stats group: replica-to-replica, i.e. cross-node, bytes


class _Slot:
    """One tensor's residuals: its hop-1 codec (per-peer residuals) and, as owner,
    the residual of its hop-2 chunk."""

    def __init__(self, key: tuple, bits: int, block: int, ef: bool) -> None:
        self.key = key
        self.send = HopCodec(bits, block, error_feedback=ef, beta=0.0, reset_every=0)
        self.own: Optional[torch.Tensor] = None


class CompressedAllReduce:
    """SUM all-reduces over a process group with `codec` ("fp32", "int8", "int4",
    "2bit"); `error_feedback` None = on at 4 bits and below."""

    def __init__(self, codec: str, *, block_size: int = 2048,
                 error_feedback: Optional[bool] = None) -> None:
        if codec not in CODECS:
            raise ValueError(f"zeropp.ft: codec={codec!r} is invalid; allowed: "
                             f"{', '.join(map(repr, CODECS))}")
        self.codec, self.bits, self.block = codec, CODECS[codec], block_size
        if self.bits is not None:
            per = 32 // self.bits  # whole 4-byte words of codes per block keep pieces aligned
            if not (isinstance(block_size, int) and block_size > 0 and block_size % per == 0):
                raise ValueError(f"zeropp.ft: block_size={block_size!r} is invalid for "
                                 f"{codec}; allowed: a positive multiple of {per}")
        self.ef = (self.bits is not None and self.bits <= 4) if error_feedback is None \
            else bool(error_feedback and self.bits is not None)
        self.stats = CommStats()
        self.round_key: Callable[[], Any] = lambda: None  # which residuals a round meets
        self._rounds: dict[Any, list[_Slot]] = {}
        self.slots: Optional[list[_Slot]] = None  # this round's, chosen at its first tensor
        self.cursor = 0

    # ---- rounds -----------------------------------------------------------------------
    def new_round(self) -> None:
        """A new step (torchft computes a quorum): residuals are matched from the first."""
        self.slots, self.cursor = None, 0
        self.stats.steps += 1

    def reset(self) -> None:
        """The membership changed: every residual goes."""
        self._rounds.clear()
        self.slots, self.cursor = None, 0

    def _slot(self, key: tuple) -> _Slot:
        if self.slots is None:  # read at the first all-reduce: a healed replica's step is set
            self.slots = self._rounds.setdefault(self.round_key(), [])
        if self.cursor < len(self.slots) and self.slots[self.cursor].key == key:
            slot = self.slots[self.cursor]
        else:  # another tensor than last round's at this position: start it afresh
            slot = _Slot(key, self.bits, self.block, self.ef)
            del self.slots[self.cursor:]
            self.slots.append(slot)
        self.cursor += 1
        return slot

    # ---- the collective ---------------------------------------------------------------
    def quantized_bytes(self, n: int, size: int) -> int:
        """What one rank sends for an n-element all-reduce over `size` ranks, quantized."""
        chunk = -(-n // (size * self.block)) * self.block
        return 2 * (size - 1) * QTensor.wire_bytes(chunk, self.bits, self.block)

    @torch.no_grad()  # LocalSGD averages the parameters themselves
    def all_reduce_(self, pg: Any, t: torch.Tensor, op: Any, rank: int, size: int) -> None:
        """t <- the op-reduction of every rank's t, in place, over `pg` (a c10d process
        group: alltoall_base, allgather, allreduce)."""
        n = t.numel()
        exact = (self.bits is None or op != dist.ReduceOp.SUM or not t.is_floating_point()
                 or ring_send(n * t.element_size(), size, 2) <= self.quantized_bytes(n, size))
        if size == 1:
            return
        if exact:
            self._exact(pg, t, op, size)
        else:
            self._quantized(pg, t, rank, size)

    def _exact(self, pg: Any, t: torch.Tensor, op: Any, size: int) -> None:
        nbytes = t.numel() * t.element_size()
        self.stats.record("allreduce/exact", group=GROUP, sent=ring_send(nbytes, size, 2),
                          inter=ring_send(nbytes, size, 2))
        opts = AllreduceOptions()
        opts.reduceOp = op
        pg.allreduce([t], opts).wait()

    def _quantized(self, pg: Any, t: torch.Tensor, rank: int, size: int) -> None:
        n, bits, block = t.numel(), self.bits, self.block
        slot = self._slot((n, size, t.dtype))
        chunk = -(-n // (size * block)) * block
        rows = torch.zeros(size * chunk, dtype=torch.float32, device=t.device)
        rows[:n].copy_(t.reshape(-1))
        rows = rows.view(size, chunk)
        wb = QTensor.wire_bytes(chunk, bits, block)
        scales = -(-chunk // block) * 4
        # hop 1: every chunk but our own, quantized to its owner; the owner sums
        send = torch.empty(size * wb, dtype=torch.uint8, device=t.device)
        slot.send.encode(rows, rank, send, wb)
        recv = torch.empty_like(send)
        sent = (size - 1) * wb
        self.stats.record("allreduce/scatter", group=GROUP, sent=sent, inter=sent,
                          scale=(size - 1) * scales)
        pg.alltoall_base(recv, send, [], [], AllToAllOptions()).wait()
        total = slot.send.decode_sum(recv, rank, rows[rank], wb)
        # hop 2: the summed chunk, quantized once (plus what its last code lost)
        if self.ef:
            if slot.own is None:
                slot.own = torch.zeros_like(total)
            total.add_(slot.own)
        wire = torch.empty(size * wb, dtype=torch.uint8, device=t.device)
        seen = torch.empty_like(total) if self.ef else None
        mine = wire[rank * wb:(rank + 1) * wb]
        quantize(total, bits, block, out=mine, dequantized=seen)
        if self.ef:
            slot.own.copy_(total.sub_(seen)).nan_to_num_(0.0, 0.0, 0.0)
        self.stats.record("allreduce/gather", group=GROUP, sent=ring_send(size * wb, size),
                          inter=ring_send(size * wb, size), scale=(size - 1) * scales)
        pieces = [wire[k * wb:(k + 1) * wb] for k in range(size)]
        pg.allgather([pieces], [mine.clone()], AllgatherOptions()).wait()
        out = torch.empty(size * chunk, dtype=torch.float32, device=t.device)
        dequantize_pieces(wire, out, pieces=size, bits=bits, block=block)
        t.copy_(out[:n].view_as(t))
