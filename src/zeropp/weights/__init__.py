"""The weight path: how a unit's full weights are assembled from the shards.

`FlatParam` owns the buffers; `WeightPath` holds one flat buffer's weight-path
state (its secondary, what version of the masters it stands for) and picks the
route of each gather. One file per technique:
  world.py         ZeRO-3's ring all-gather over the world; qwZ's INT8 payload on it
  hpz.py           hpZ: the secondary shard kept after a gather, and gathers inside
                   the group from it
  hierarchical.py  the two-stage gather: across nodes, then inside the node
  delta.py         qWD: secondaries kept across steps, refreshed by deltas

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

from ..collectives import Comm, Pending
from ..quant import QTensor
from . import delta, hierarchical, hpz, world

if TYPE_CHECKING:
    from ..config import Config
    from ..flat_param import FlatParam
    from ..topology import Topology


class WeightPath:
    def __init__(self, flat: FlatParam, topo: Topology, cfg: Config) -> None:
        self.flat = flat
        w, d = topo.world_size, topo.node_size
        self.p = cfg.hpz_partition_size            # hpZ group size (1 = no secondary)
        self.index = topo.rank % self.p            # i: this rank's index in its hpZ group
        # Two stages need a real node boundary; P must then be the node size (or
        # 1) so that stage 1 is the inter-node group (hpz.py, the layout note).
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

    def before_step(self) -> None:
        """Before an optimizer step: a master shard changed since its copy was made
        current (not by a step) must be refreshed in full, not by delta."""
        v = self.flat.version
        if self.secondary is not None and v not in (self.current_for, self.stepped_at):
            self.invalidate()

    def issue(self, comm: Comm, phase: str) -> Pending:
        """Start assembling the full weights into `flat.full`; the returned Pending
        completes the remaining stages when waited on."""
        route, op = self.route(), f"all_gather/{phase}"
        if route == "secondary":
            return hpz.issue(self, comm, op)
        if route == "delta":
            return delta.issue(self, comm, op)
        if route == "hier":
            return hierarchical.issue(self, comm, op)
        return world.issue(self, comm, op)

    @property
    def recodes(self) -> bool:
        """Whether qWD's copies differ from the gathered pieces as they come: exact
        copies of qwZ's INT8, or codes of a gather that is exact or of other bits."""
        f = self.flat
        return self.delta and (not f.quantized_gather or self.copy_bits != f.weight_bits)

    @property
    def is_wire(self) -> bool:
        """Whether the secondary holds wire bytes (qwZ without qWD) rather than weights."""
        return self.flat.quantized_gather and not self.delta

    @property
    def wire_bytes(self) -> int:
        f = self.flat
        return QTensor.wire_bytes(f.shard_numel, f.weight_bits, f.block)

    @property
    def scale_bytes(self) -> int:
        return self.flat.shard_numel // self.flat.block * 4

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
        hpz.set_secondary(self, state["secondary"].to(self.flat.full.device))
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
