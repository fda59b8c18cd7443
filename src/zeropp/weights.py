"""The weight path: how a unit's full weights are assembled from the shards.

Everything that moves weights lives here: ZeRO-3's world gather, qwZ's INT8
payload, hpZ's secondary shard, the hierarchical (two-stage) gather and qWD's
weight-delta refresh. `FlatParam` owns the buffers; `WeightPath` decides the
route of each gather and runs it.

[Note: the secondary shard's layout]
With hpZ groups of P ranks, rank r (index i = r mod P in its group) keeps the
primary shards of the W/P ranks k*P + i, k = 0..W/P-1, as its *secondary*
(piece k = rank k*P+i's shard). For P = D these are the ranks sharing r's local
index, one per node: exactly the inter-node group, so the first stage of a
hierarchical gather (an all-gather in that group) outputs the secondary itself,
with no copy, and the owner of a primary shard and every holder of a copy of it
are one inter-node group, which is what qWD's deltas travel in. A gather from
secondaries (inside the hpZ group) receives the pieces in (i, k) order and
places piece (i, k) at slot k*P + i: the same bytes a world gather puts there.

[Note: routes]
  world     ZeRO-3 / qwZ: one ring over the world (W-1)/W of the payload per node
            across; with hpZ the rank then keeps its pieces of the result.
  hier      stage 1 across nodes among same-local-index ranks -> the N pieces of
            the secondary; stage 2 inside the node. (N-1)/N of the payload per
            node crosses. Bitwise equal to `world` (but for a full refresh of qWD's
            INT8 copies without qwZ's INT8: the forward then computes with the copies).
  secondary hpZ: stage 2 only, from a current secondary (nothing crosses nodes).
  delta     qWD: the secondary persists across steps. After an optimizer step each
            owner all-gathers a delta of its shard in the inter-node group, every
            holder (the owner too) applies it to its copy; then stage 2. Copies
            stay bitwise identical everywhere.

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

[Note: when qWD refreshes in full]
A full refresh (the `hier` or `world` route; INT8 with qwZ, else exact) runs on
the first gather, after a checkpoint load at another layout, when the master
shard changed by anything but an optimizer step (its version counter moved
after the step hook ran, or its storage was replaced), after
`zeropp.refresh(model)`, and every `weight_refresh_every` steps. An in-place
write through `.data` is invisible to version counters: it reaches the copies
through the next delta (INT-quantized); call `zeropp.refresh(model)` to send it
exactly. Memory: the persistent secondary costs W/P shards per rank (1/D of the
model) as INT8 blocks, 1 byte/param / D (exact copies: the compute dtype's
width), where qwZ+hpZ keeps the same bytes only between a forward and the next step.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Optional

import torch

from . import qwd
from .collectives import Comm, Pending, dequantize_gathered
from .quant import QTensor, dequantize, quantize, scratch_buffer

if TYPE_CHECKING:
    from .config import Config
    from .flat_param import FlatParam
    from .topology import Topology


class WeightPath:
    def __init__(self, flat: FlatParam, topo: Topology, cfg: Config) -> None:
        self.flat = flat
        w, d = topo.world_size, topo.node_size
        self.p = cfg.hpz_partition_size            # hpZ group size (1 = no secondary)
        self.index = topo.rank % self.p            # i: this rank's index in its hpZ group
        # Two stages need a real node boundary; P must then be the node size (or
        # 1) so that stage 1 is the inter-node group (see the note).
        self.hierarchical = cfg.hierarchical_gather and 1 < d < w
        self.delta = cfg.weight_delta and flat.trainable and w // d > 1
        if (self.hierarchical or cfg.weight_delta) and self.p not in (1, d):
            raise ValueError(f"zeropp: hierarchical_gather / weight_delta need "
                             f"hpz_partition_size 1 or the node size {d}, got {self.p}")
        self.outer_index = topo.rank // d          # this rank's index in its inter-node group
        self.delta_bits, self.refresh_every = cfg.weight_delta_bits, cfg.weight_refresh_every
        self.stochastic = cfg.weight_delta_stochastic_rounding
        self.generator: Optional[torch.Generator] = None  # the owner's rounding (stochastic)
        self.seed = topo.rank * 1_000_003 + 7 + zlib.crc32(flat.name.encode())
        self.secondary: Optional[torch.Tensor] = None  # W/P pieces: wire bytes or compute dtype
        self.current_for: Optional[tuple] = None  # master version the secondary stands for
        self.stepped_at: Optional[tuple] = None   # master version right after the last step
        # qWD's copies as wire bytes of this many bits (None: exact, at the compute dtype)
        self.copy_bits = cfg.weight_copy_bits if self.delta else None
        self.deltas = 0                           # deltas since the last full refresh

    # ---- state -----------------------------------------------------------------------
    def after_step(self) -> None:
        """An optimizer step updated the master shard: qWD keeps the copy and sends a
        delta at the next gather; plain hpZ drops it (its next gather is a full one)."""
        if self.delta and self.secondary is not None:
            self.stepped_at, self.current_for = self.flat.version, None
        else:
            self.invalidate()

    def invalidate(self) -> None:
        """Forget the secondary: the next gather is a full one."""
        self.secondary = self.current_for = self.stepped_at = None

    def route(self) -> str:
        v = self.flat.version
        if self.secondary is not None and self.current_for == v:
            return "secondary"
        if (self.secondary is not None and self.stepped_at == v
                and (self.refresh_every is None or self.deltas < self.refresh_every)):
            return "delta"
        return "hier" if self.hierarchical else "world"

    # ---- gathers -----------------------------------------------------------------------
    def issue(self, comm: Comm, phase: str) -> Pending:
        """Start assembling the full weights into `flat.full`; the returned Pending
        completes the remaining stages when waited on."""
        route, op = self.route(), f"all_gather/{phase}"
        if route == "secondary":
            if self.copy_bits is not None:
                return self._inner(comm, self.secondary, f"{op}/hpz", "hpz", self.copy_bits)
            return self._inner(comm, self.secondary, f"{op}/hpz", "hpz",
                               self.flat.weight_bits if self._is_wire else None)
        if route == "delta":
            return self._issue_delta(comm, op)
        if route == "hier":
            return self._issue_outer(comm, op)
        return self._issue_world(comm, op)

    @property
    def _recodes(self) -> bool:
        """Whether qWD's copies differ from the gathered pieces as they come: exact
        copies of qwZ's INT8, or codes of a gather that is exact or of other bits."""
        f = self.flat
        return self.delta and (not f.quantized_gather or self.copy_bits != f.weight_bits)

    @property
    def _is_wire(self) -> bool:
        """Whether the secondary holds wire bytes (qwZ without qWD) rather than weights."""
        return self.flat.quantized_gather and not self.delta

    def _send(self) -> torch.Tensor:
        """This rank's contribution to a full gather: its primary shard in the
        compute dtype or, with qwZ, quantized (payload and scales in one buffer)."""
        f = self.flat
        shard = f.primary_shard.detach()
        if f.int_storage:
            return shard
        if f.quantized_gather:
            return quantize(shard, f.weight_bits, f.block).to_bytes()
        return shard.to(f.compute_dtype)

    def _gather_buffer(self, pieces: int) -> tuple[torch.Tensor, int]:
        f = self.flat
        if f.quantized_gather:
            return (torch.empty(pieces * self._wire_bytes, dtype=torch.uint8,
                                device=f.full.device), self._scale_bytes * pieces)
        return torch.empty(pieces * f.shard_numel, dtype=f.compute_dtype,
                           device=f.full.device), 0

    @property
    def _wire_bytes(self) -> int:
        f = self.flat
        return QTensor.wire_bytes(f.shard_numel, f.weight_bits, f.block)

    @property
    def _scale_bytes(self) -> int:
        return self.flat.shard_numel // self.flat.block * 4

    def _issue_world(self, comm: Comm, op: str) -> Pending:
        f = self.flat
        w = f.world_size
        if f.quantized_gather:
            out, scales = self._gather_buffer(w)

            def then() -> None:
                dequantize_gathered(out, f.full, pieces=w, bits=f.weight_bits, block=f.block)
                self._keep(out, wire=True)
            return comm.all_gather(out, self._send(), op=op, group="world", scale_bytes=scales,
                                   then=then)
        return comm.all_gather(f.full, self._send(), op=op, group="world",
                               then=lambda: self._keep(f.full, wire=False))

    def _keep(self, gathered: torch.Tensor, *, wire: bool) -> None:
        """hpZ after a world gather: keep this rank's pieces k*P + i of the result
        (wire bytes as received, qWD's INT8 copies, or its exact ones)."""
        if self.p == 1:
            return
        f = self.flat
        if self._recodes:
            gathered, wire = f.full, False  # take the copies from the full weights
        mine = gathered.view(-1, self.p, gathered.numel() // f.world_size)[:, self.index]
        if self.copy_bits is not None and not wire:
            self._set_secondary(self._as_codes(mine))
        else:
            self._set_secondary(mine.clone().view(-1))

    def _set_secondary(self, secondary: torch.Tensor) -> None:
        self.secondary, self.current_for, self.stepped_at = secondary, self.flat.version, None
        self.deltas = 0

    def _as_codes(self, pieces: torch.Tensor) -> torch.Tensor:
        """qWD's copies of weight `pieces` (n, shard) as wire bytes, one piece per shard."""
        f = self.flat
        wb = QTensor.wire_bytes(f.shard_numel, self.copy_bits, f.block)
        out = torch.empty(len(pieces) * wb, dtype=torch.uint8, device=pieces.device)
        for k, c in enumerate(pieces):
            quantize(c, self.copy_bits, f.block, out=out[k * wb:(k + 1) * wb])
        return out

    def _issue_outer(self, comm: Comm, op: str) -> Pending:
        """Hierarchical stage 1: the N primary shards of this rank's local index,
        across nodes; its output is the secondary (hpZ at the node size)."""
        n = self.flat.world_size // comm.topo.node_size
        out, scales = self._gather_buffer(n)

        def then() -> None:
            f = self.flat
            wire = f.quantized_gather
            mine, bits = out, (f.weight_bits if wire else None)
            if self.p > 1:
                if self._recodes:  # the copies are weights, or codes of other bits
                    mine, bits = (self._dequantized(out, n) if wire else out), None
                    if self.copy_bits is not None:
                        mine, bits = self._as_codes(mine.view(n, -1)), self.copy_bits
                self._set_secondary(mine)  # qWD's INT8 copies: qwZ's pieces as they came
            self._inner(comm, mine, f"{op}/intra", "intra_node", bits).wait()
        return comm.all_gather(out, self._send(), op=f"{op}/inter", group="inter_node",
                               scale_bytes=scales, then=then)

    def _dequantized(self, wire: torch.Tensor, pieces: int) -> torch.Tensor:
        f = self.flat
        out = torch.empty(pieces * f.shard_numel, dtype=f.compute_dtype, device=wire.device)
        dequantize_gathered(wire, out, pieces=pieces, bits=f.weight_bits, block=f.block)
        return out

    def _inner(self, comm: Comm, mine: torch.Tensor, op: str, group: str,
               bits: Optional[int]) -> Pending:
        """Stage 2: all-gather every group member's pieces inside the group (hpZ
        group or node, G ranks) and place member i's piece k at slot k*G + i.
        `bits`: the pieces are wire bytes of that many bits (None: weights)."""
        f = self.flat
        g = len(comm.ranks[group])
        k = f.world_size // g
        out = torch.empty(g * mine.numel(), dtype=mine.dtype, device=mine.device)
        if bits is not None:
            wb = QTensor.wire_bytes(f.shard_numel, bits, f.block)

            def then() -> None:
                pieces = out.view(g, k, wb)
                for i in range(g):
                    for j in range(k):
                        q = QTensor.from_bytes(pieces[i, j], (f.shard_numel,), f.compute_dtype,
                                               bits, f.block)
                        s = (j * g + i) * f.shard_numel
                        dequantize(q, out=f.full[s:s + f.shard_numel])
            return comm.all_gather(out, mine, op=op, group=group,
                                   scale_bytes=self._scale_bytes * g * k, then=then)

        def place() -> None:
            f.full.view(k, g, -1).copy_(out.view(g, k, -1).transpose(0, 1))
        return comm.all_gather(out, mine, op=op, group=group, then=place)

    def before_step(self) -> None:
        """Before an optimizer step: a master shard changed since its copy was made
        current (not by a step) must be refreshed in full, not by delta."""
        v = self.flat.version
        if self.secondary is not None and v not in (self.current_for, self.stepped_at):
            self.invalidate()

    def _issue_delta(self, comm: Comm, op: str) -> Pending:
        """qWD: every owner sends a delta of its shard to the shard's holders (the
        inter-node group); each applies it to its copy, then stage 2."""
        if self.stochastic and self.generator is None:
            self.generator = torch.Generator(device=self.flat.full.device).manual_seed(self.seed)
        n = self.flat.world_size // self.p
        encode = self._code_delta if self.copy_bits is not None else self._value_delta
        send, apply, meta_bytes = encode(self.secondary.view(n, -1))
        out = torch.empty(n * send.numel(), dtype=torch.uint8, device=send.device)
        # Until `then` has run, the copies are mid-update (the owner's piece holds its
        # delta already): if the collective fails, the next gather refreshes in full,
        # rebuilding every holder's copies from the masters, rather than resending.
        version, self.stepped_at = self.stepped_at, None

        def then() -> None:
            for k, piece in enumerate(out.view(n, -1)):
                if k != self.outer_index:  # the owner's own piece moved at the encode
                    apply(k, piece)        # the same ops on every holder
            self.current_for, self.stepped_at = version, None
            self.deltas += 1
            self._inner(comm, self.secondary, f"{op}/hpz", "hpz", self.copy_bits).wait()
        return comm.all_gather(out, send, op=f"{op}/delta", group="inter_node",
                               scale_bytes=n * meta_bytes, then=then)

    def _value_delta(self, copies: torch.Tensor):
        """Exact copies: the owner sends q(master - its copy) and adds what every holder
        will decode (the encode's `dequantized`, bit for bit) instead of unpacking its
        own bytes. Returns (bytes to send, apply(k, piece), non-code bytes per piece)."""
        f = self.flat
        numel = f.shard_numel
        diff = torch.sub(f.primary_shard.detach().float(), copies[self.outer_index].float(),
                         out=scratch_buffer("delta", numel, copies.device))
        own = scratch_buffer("delta_own", numel, copies.device)
        send = quantize(diff, self.delta_bits, f.block, stochastic=self.stochastic,
                        generator=self.generator, dequantized=own).to_bytes()
        copies[self.outer_index].add_(own)

        def apply(k: int, piece: torch.Tensor) -> None:
            q = QTensor.from_bytes(piece, (numel,), torch.float32, self.delta_bits, f.block)
            copies[k].add_(dequantize(q, out=scratch_buffer("delta_part", numel, piece.device)))
        return send, apply, numel // f.block * 4

    def _code_delta(self, copies: torch.Tensor):
        """INT8 copies: the owner moves its copy's codes to qwZ's INT8 of its master and
        sends how they moved (qwd.py); holders move theirs the same. Returns as above."""
        f = self.flat
        kw = dict(copy_bits=self.copy_bits, delta_bits=self.delta_bits, block=f.block)
        send = torch.empty(qwd.wire_bytes(f.shard_numel, **kw), dtype=torch.uint8,
                           device=copies.device)
        qwd.encode(f.primary_shard.detach(), copies[self.outer_index], send,
                   stochastic=self.stochastic, generator=self.generator, **kw)

        def apply(k: int, piece: torch.Tensor) -> None:
            qwd.apply(copies[k], piece, numel=f.shard_numel, **kw)
        return send, apply, qwd.meta_bytes(f.shard_numel, f.block)

    # ---- checkpoints -------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """qWD state a bit-exact resume needs: the copies and whether a delta is due."""
        if not self.delta or self.secondary is None:
            return {}
        due = self.stepped_at is not None and self.stepped_at == self.flat.version
        if not due and self.current_for != self.flat.version:
            return {}  # stale by an outside change: the next gather refreshes in full anyway
        out = {"secondary": self.secondary.detach().cpu(),
               "delta_due": torch.tensor([int(due), self.deltas])}
        if self.generator is not None:
            out["generator"] = self.generator.get_state()
        return out

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore `state()` after the master shard was loaded (same layout)."""
        self.invalidate()
        self.generator = None
        if "generator" in state and self.stochastic:
            self.generator = torch.Generator(device=self.flat.full.device).manual_seed(self.seed)
            self.generator.set_state(state["generator"])
        if "secondary" not in state or not self._fits(state["secondary"]):
            return  # none saved, or saved in another form (exact copies): refresh in full
        self._set_secondary(state["secondary"].to(self.flat.full.device))
        due, self.deltas = (int(x) for x in state["delta_due"])
        if due:
            self.stepped_at, self.current_for = self.current_for, None

    def _fits(self, secondary: torch.Tensor) -> bool:
        """Whether saved copies have this configuration's form (codes or exact)."""
        f = self.flat
        n = f.world_size // self.p
        if self.copy_bits is not None:
            want = (torch.uint8, n * QTensor.wire_bytes(f.shard_numel, self.copy_bits, f.block))
        else:
            want = (f.compute_dtype, n * f.shard_numel)
        return (secondary.dtype, secondary.numel()) == want
