"""qgZ: the hierarchical quantized gradient reduce-scatter, and the quantizer of each
of its two hops.

Hop 1 (inside the node) quantizes with `intra_node_grad_bits` (8 by default: it costs no inter-node
byte). Hop 2 (across nodes) is where bytes are scarce and INT4 error hurts; its codec (`HopCodec`)
may add error feedback (`gradient_error_feedback`): the sender keeps what quantization lost and adds
it to its next send (LoCo-style moving average e <- b*e + (1-b)*r, b = 0.8, reset every 1024 sends).
State: (N-1) chunks of fp32 per unit per rank, i.e. (N-1)/W of the unit's padded size; saved in
checkpoints. A rank never quantizes the piece it keeps for itself (the all-to-all's own slot): it
adds it in fp32, so only bytes that travel are rounded.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..collectives import Comm
from ..config import Config
from ..quant import QTensor, dequantize, quantize, scratch_buffer
from ..topology import Topology

ERROR_BETA = 0.8         # LoCo's err_beta: weight of the older residual
ERROR_RESET = 1024       # LoCo's reset period, in sends


class HopCodec:
    """Quantizes the rows of one hop's all-to-all (round to nearest) and sums what
    arrives; with `error_feedback` each row's residual rides on its next send."""

    def __init__(self, bits: int, block: int, *, error_feedback: bool = False,
                 beta: float = ERROR_BETA, reset_every: int = ERROR_RESET) -> None:
        """`beta` 0 and `reset_every` 0: plain error feedback (the whole residual rides
        on the next send, never reset), as zeropp.ft's 2-bit all-reduce runs it."""
        self.bits, self.block, self.error_feedback = bits, block, error_feedback
        self.beta, self.reset_every = beta, reset_every
        self.residual: Optional[torch.Tensor] = None   # rows sent to peers, in send order
        self.sends = 0

    def encode(self, rows: torch.Tensor, own: int, send: torch.Tensor, wb: int) -> None:
        """Quantize every row but `own` into its slot of `send` (wire format)."""
        k, numel = rows.shape
        if self.error_feedback:
            if self.residual is None or self.residual.shape != (k - 1, numel):
                self.residual = torch.zeros(k - 1, numel, dtype=torch.float32,
                                            device=rows.device)
            if self.reset_every and self.sends % self.reset_every == 0:
                self.residual.zero_()
            self.sends += 1
        for peer, r in enumerate(i for i in range(k) if i != own):
            x, seen = rows[r], None
            if self.error_feedback:
                x = torch.add(x, self.residual[peer], out=scratch_buffer("ef_x", numel, x.device))
                seen = scratch_buffer("ef_dq", numel, x.device)
            quantize(x, self.bits, self.block, out=send[r * wb:(r + 1) * wb], dequantized=seen)
            if self.error_feedback:  # what the peer will decode, without unpacking it here
                res = self.residual[peer]
                if self.beta == 0:
                    res.copy_(x.sub_(seen))
                else:
                    res.mul_(self.beta).add_(x.sub_(seen), alpha=1 - self.beta)
                res.nan_to_num_(0.0, 0.0, 0.0)  # a non-finite block's would stay so for good

    def decode_sum(self, recv: torch.Tensor, own: int, own_row: torch.Tensor,
                   wb: int) -> torch.Tensor:
        """fp32 sum of the pieces received (all rows but `own`) and `own_row`."""
        k, numel = recv.numel() // wb, own_row.numel()
        # The first piece is dequantized straight into the sum (no zero fill; one
        # piece is all that arrives at two ranks per group), the rest through `part`.
        total, part = None, None
        for r in (i for i in range(k) if i != own):
            q = QTensor.from_bytes(recv[r * wb:(r + 1) * wb], (numel,), torch.float32,
                                   self.bits, self.block)
            if total is None:
                total = dequantize(q, torch.float32)
            else:
                part = torch.empty_like(total) if part is None else part
                total += dequantize(q, out=part)
        if total is None:
            total = torch.zeros(numel, dtype=torch.float32, device=own_row.device)
        return total.add_(own_row)

    # ---- checkpoints: what a bit-exact resume needs -----------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        return {} if self.residual is None else {
            "residual": self.residual.detach().cpu(), "sends": torch.tensor([self.sends])}

    def load_state(self, state: dict[str, torch.Tensor], device: torch.device) -> None:
        self.residual, self.sends = None, 0
        if "residual" in state and self.error_feedback:
            self.residual = state["residual"].to(device, torch.float32)
            self.sends = int(state["sends"][0])


class QgzReduce:
    """qgZ's gradient route: the mean over the world of `g` (W equal chunks of whole
    blocks), this rank's chunk, by two quantized all-to-alls.

    Hop 1 (inside the node): chunk p is for rank p = m*D + j; the N chunks for local index j go,
    quantized, to local peer j, which sums the D pieces it holds in fp32. Hop 2 (across nodes, among
    the ranks of local index j): the node-partial sum for node m goes, quantized by `codec`, to node
    m, which sums the N pieces in fp32. Across its boundary a node sends (N-1)/N of |g| values at
    `codec.bits` each (plus scales) where a ring sends (W-1)/W of them at full width. One node or
    one rank per node skips the hop that would move nothing; padding, not fallbacks, handles any
    size. Stage 1 is hop 1 and hop 2's quantization; stage 2 only hop 2's exchange, so the thread
    holding the slow link only sends. Sums are fp32 whatever the reduce dtype.
    """

    def __init__(self, *, block: int, intra_bits: int, codec: HopCodec,
                 op: str = "reduce_scatter/qgz") -> None:
        self.block, self.intra_bits, self.codec, self.op = block, intra_bits, codec, op

    @classmethod
    def from_config(cls, cfg: Config, *, block: int) -> QgzReduce:
        return cls(block=block, intra_bits=cfg.intra_node_grad_bits or cfg.grad_bits,
                   codec=HopCodec(cfg.grad_bits, block, error_feedback=cfg.gradient_error_feedback))

    def first(self, comm: Comm, g: torch.Tensor) -> tuple:
        partial = qgz_intra_hop(comm, g.float(), block=self.block, intra_bits=self.intra_bits,
                                op=self.op)
        return qgz_inter_encode(comm.topo, partial, inter=self.codec)

    def second(self, comm: Comm, encoded: tuple) -> torch.Tensor:
        return qgz_inter_exchange(comm, encoded, inter=self.codec, op=self.op)

    def reduce(self, comm: Comm, g: torch.Tensor) -> torch.Tensor:
        return self.second(comm, self.first(comm, g))


def reduce_scatter_qgz(comm: Comm, g: torch.Tensor, *, block: int, intra_bits: int,
                       inter: HopCodec, op: str = "reduce_scatter/qgz") -> torch.Tensor:
    """qgZ's reduce-scatter of `g` (see QgzReduce): the two stages the engine runs."""
    return QgzReduce(block=block, intra_bits=intra_bits, codec=inter, op=op).reduce(comm, g)


def qgz_intra_hop(comm: Comm, g: torch.Tensor, *, block: int, intra_bits: int,
                  op: str = "reduce_scatter/qgz") -> torch.Tensor:
    """qgZ's first hop: this node's partial sums of the N chunks for this local
    index (N * |g|/W values; `g` itself reshaped when there is one rank per node).
    The reduce pipeline runs it for unit k+1 while unit k's second hop holds the link."""
    topo = comm.topo
    n, d, own = topo.num_nodes, topo.node_size, topo.local_rank
    chunk = g.numel() // topo.world_size
    by_local = g.view(n, d, chunk).transpose(0, 1)  # [j, m]: slot (p mod D)*N + p // D
    if d == 1:
        return by_local.reshape(-1)  # no intra-node hop: nothing to quantize
    codec = HopCodec(intra_bits, block)
    return _exchange_sum(comm, _encode(by_local.reshape(d, n * chunk), codec, own),
                         group="intra_node", op=f"{op}/intra", codec=codec, own=own)


def qgz_inter_encode(topo: Topology, partial: torch.Tensor, *, inter: HopCodec) -> tuple:
    """The second hop's quantization (no communication): the reduce pipeline
    runs it beside the first hop, so the thread holding the link only sends."""
    return (None, partial) if topo.num_nodes == 1 else _encode(
        partial.view(topo.num_nodes, -1), inter, topo.node)


def qgz_inter_exchange(comm: Comm, encoded: tuple, *, inter: HopCodec, op: str) -> torch.Tensor:
    """The second hop's all-to-all among the ranks of this local index, the
    fp32 sum of what arrives with this rank's own row, divided by W."""
    topo = comm.topo
    mine = encoded[1] if encoded[0] is None else _exchange_sum(  # None: one node, no hop
        comm, encoded, group="inter_node", op=f"{op}/inter", codec=inter, own=topo.node)
    return mine / topo.world_size


def _encode(rows: torch.Tensor, codec: HopCodec, own: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row but `own`, quantized into its slot of one wire buffer (row k goes to
    group rank k); and row `own`, which stays here unquantized."""
    k, numel = rows.shape
    wb = QTensor.wire_bytes(numel, codec.bits, codec.block)
    send = torch.empty(k * wb, dtype=torch.uint8, device=rows.device)
    codec.encode(rows, own, send, wb)
    return send, rows[own]


def _exchange_sum(comm: Comm, encoded: tuple, *, group: str, op: str, codec: HopCodec,
                  own: int) -> torch.Tensor:
    """All-to-all of `_encode`'s rows; the fp32 sum of the rows received and the own row."""
    send, own_row = encoded
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, op=op, group=group,
                    scale_bytes_per_peer=-(-own_row.numel() // codec.block) * 4)
    return codec.decode_sum(recv, own, own_row, send.numel() // len(comm.ranks[group]))
