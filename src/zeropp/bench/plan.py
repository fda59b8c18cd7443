"""`zeropp plan`: what each configuration costs per step on a cluster you describe.

An alpha-beta model: every collective costs `alpha` per message hop plus bytes
over bandwidth. Bytes come from the same rules the accounting uses
(collectives.py, [Note: counting bytes]): ring gathers and reduce-scatters send
(G-1)/G of the buffer, and a node-major ring crosses each node boundary once,
so a node's link carries (W-1)/W of each world-group buffer; hpZ's gathers stay
inside the node; qgZ's second hop sends (N-1)/N of the values at 4 bits.
zeropp-plus: the forward and backward gathers run inside the node from qWD's
copies (qwZ's INT8 blocks); across nodes go the INT4 weight deltas
((N-1)/N of the values) and qgZ's INT4 hop; its intra-node gradient hop is 8-bit.
Compute is 6 * params * tokens FLOPs (forward + backward) at the given
TFLOP/s, 8 * params * tokens with activation checkpointing (`recompute`: the
forward runs again in backward; the ZeRO++ runs and their TFLOP/s figures count
it). `overlap` is the fraction of the shorter of compute and communication
hidden behind the longer (0 on CPU/gloo, where neither FSDP2 nor DeepSpeed
overlaps; high on GPUs with NCCL streams), phase by phase: the forward's
gathers can only hide behind the forward's compute (2 of the 6 or 8 FLOPs per
parameter and token) and the backward's traffic behind the backward's, since
the optimizer step between them needs every gradient and makes the weights the
next forward gathers (`zeropp bench`'s phase bound measures the same). With
overlap 1 a step is max(forward compute, forward comm) + max(backward compute,
backward comm), which is above max(compute, comm) where the traffic sits in one
phase (ZeRO++'s: qwZ's forward gather) and equal to it where it splits like the
compute (ZeRO-3's without recomputation and with `reduce_bytes` = `param_bytes`:
one gather forward, a gather and a reduce-scatter backward, 1:2 as the FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import qwd
from ..config import NAMED, is_named
from ..quant import QTensor
from ..stats import ring_send


def _switches(switches: dict) -> tuple[bool, bool, bool, bool]:
    """What the cost model distinguishes: qwZ, hpZ, qgZ, and zeropp-plus's qWD
    (with its 8-bit intra-node gradients)."""
    return (switches.get("quantized_weights", False), switches.get("hpz_partition_size", 1) != 1,
            switches.get("quantized_gradients", False), switches.get("weight_delta", False))


CONFIGS = {name: _switches(switches) for name, switches in NAMED.items()}


@dataclass(frozen=True)
class Cluster:
    params: float
    nodes: int
    gpus_per_node: int
    inter_gbps: float          # per node link, each direction
    intra_gbps: float          # per GPU, inside a node
    tokens_per_gpu: int
    tflops: float              # achieved per GPU
    param_bytes: int = 2       # compute dtype (bf16/fp16)
    reduce_bytes: int = 2      # gradient reduce-scatter width (DeepSpeed: fp16)
    block_size: int = 2048
    units: int = 32            # gathered units (transformer blocks)
    alpha_us: float = 10.0     # per message hop
    overlap: float = 0.0
    compute_s: float = 0.0     # measured compute per step; overrides the FLOP estimate
    recompute: bool = False    # activation checkpointing: the forward runs twice (8 PT FLOPs)

    def __post_init__(self) -> None:
        for name in ("params", "inter_gbps", "intra_gbps", "tflops", "tokens_per_gpu"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be positive")
        for name in ("nodes", "gpus_per_node", "units", "block_size"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap={self.overlap!r} must be in [0, 1]")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


def volumes(p: float, w: int, n: int, param_bytes: int, reduce_bytes: int, block_size: int,
            qwz: bool, hpz: bool, qgz: bool, plus: bool = False) -> dict[str, float]:
    """Bytes per step of `p` parameters on `n` nodes of `w` ranks: crossing each node's
    link (fwd, bwd, grad) and sent inside the node by each GPU (intra, of which the
    forward's: intra_fwd), plus the hpZ secondary's bytes per GPU. Rings by
    stats.ring_send, the accounting's own rule."""
    d = w // n
    m = p * param_bytes
    # Bytes per value on the wire, as the codecs lay them out (a block's codes and its
    # fp32 scale; qWD's 4-bit deltas also a step byte per block, four blocks to a word)
    int8, int4 = (QTensor.wire_bytes(block_size, b, block_size) / block_size for b in (8, 4))
    delta = qwd.wire_bytes(4 * block_size, block_size) / (4 * block_size)
    gather = p * int8 if qwz else m      # qwZ's INT8 blocks, or full width
    cross = n > 1
    fwd = ring_send(gather, w) if cross else 0.0
    bwd = 0.0 if (hpz or not cross) else ring_send(gather, w)
    if qgz:  # INT4 values, (N-1)/N of them leave the node
        grad = ring_send(p * int4, n)
    else:
        grad = ring_send(p * reduce_bytes, w) if cross else 0.0
    intra = 0.0
    if hpz:  # backward gather among the D GPUs of the node
        intra += ring_send(gather, d)
    if qgz and d > 1:  # first hop: INT4 all-to-all inside the node
        intra += ring_send(p * int4, d)
    secondary = (p / d) * int8 if (hpz and qwz) else (m / d if hpz else 0.0)
    intra_fwd = 0.0  # the part of `intra` the forward moves
    if plus:  # qWD's deltas across; both gathers inside, from the copies, which are
        # INT8 blocks like ZeRO++'s secondary
        fwd = ring_send(p * delta, n) if cross else 0.0
        intra_fwd = ring_send(p * int8, d)
        intra = 3 * intra_fwd                       # + the backward's and the 8-bit gradient hop
        secondary = p / d * int8
    return {"fwd": fwd, "bwd": bwd, "grad": grad, "cross": fwd + bwd + grad,
            "intra": intra, "intra_fwd": intra_fwd, "secondary": secondary}


def predict(c: Cluster, name: str) -> dict[str, float]:
    qwz, hpz, qgz, plus = CONFIGS[name]
    v = volumes(c.params, c.world, c.nodes, c.param_bytes, c.reduce_bytes, c.block_size,
                qwz, hpz, qgz, plus)
    inter_bw, intra_bw = c.inter_gbps * 1e9 / 8, c.intra_gbps * 1e9 / 8
    # messages per step: 3 ring collectives per unit of W-1 hops (hpZ's backward
    # gather has D-1 hops; qgZ's two all-to-alls one hop each)
    d, n = c.gpus_per_node, c.nodes
    fwd_hops = (n - 1) + (d - 1) if plus else c.world - 1
    bwd_hops = ((d - 1) if hpz else (c.world - 1)) + (2 if qgz else c.world - 1)
    alpha = c.units * c.alpha_us * 1e-6
    comm_fwd = alpha * fwd_hops + v["fwd"] / inter_bw + v["intra_fwd"] / intra_bw
    comm_bwd = (alpha * bwd_hops + (v["bwd"] + v["grad"]) / inter_bw
                + (v["intra"] - v["intra_fwd"]) / intra_bw)
    per_token = 8 if c.recompute else 6
    compute = c.compute_s or per_token * c.params * c.tokens_per_gpu / (c.tflops * 1e12)
    step = 0.0
    for comp, comm in ((compute * 2 / per_token, comm_fwd),
                       (compute * (per_token - 2) / per_token, comm_bwd)):
        step += comp + comm - c.overlap * min(comp, comm)
    return {**v, "comm_s": comm_fwd + comm_bwd, "compute_s": compute, "step_s": step}


def plan(c: Cluster) -> list[dict]:
    rows = [{"config": k, **predict(c, k)} for k in CONFIGS]
    base = rows[0]["step_s"]
    for r in rows:
        r["speedup"] = base / r["step_s"]
    return rows


def recommend(rows: list[dict]) -> str:
    by = {r["config"]: r for r in rows}
    gains = {k: by["zero3"]["step_s"] / by[k]["step_s"] for k in ("qwz", "hpz", "qgz")}
    on = [k for k, g in gains.items() if g > 1.05]
    if not on:
        return ("Communication is not the bottleneck here: plain ZeRO-3 is as fast "
                "(no switch saves 5% alone).")
    names = {"qwz": "quantized_weights=True", "hpz": "hpz_partition_size=<GPUs per node>",
             "qgz": "quantized_gradients=True"}
    pair = {k: by[k]["step_s"] for k in ("zeropp", "zeropp-plus")}
    line = ("Turn on " + ", ".join(names[k] for k in on)
            + f"; all three predict {by['zeropp']['speedup']:.2f}x over ZeRO-3, "
            f"zeropp-plus {by['zeropp-plus']['speedup']:.2f}x. " + winner(pair, "predicted"))
    if max(pair.values()) < (1 + NEAR_TIE) * min(pair.values()):
        line += (f" The two presets are within {NEAR_TIE:.0%} here, and this model leaves "
                 "out zeropp-plus's extra quantization passes (measured on CPU: its compute "
                 "0.96-1.10x ZeRO++'s): measure with `zeropp bench --rounds 3`.")
    return line


# Below this margin the preset choice rests on what the model leaves out: zeropp-plus's
# quantization passes (qWD's delta encode and apply, its 8-bit intra-node gradient hop,
# error feedback) make its unshaped step 0.96-1.10x ZeRO++'s on this CPU (medians of
# rounds and paired steps; benchmarks/RESULTS.md, "zeropp-plus's compute").
NEAR_TIE = 0.05


def winner(step_s: dict[str, float], how: str) -> str:
    """One line: which configuration has the shortest step, and by how much over
    the next; a zeropp preset is named as the Config call that selects it."""
    ranked = sorted(step_s, key=step_s.get)
    best = ranked[0]
    use = f"Config.preset({best!r})" if is_named(best) else best
    line = f"Fastest ({how}): {use} at {step_s[best]:.3g} s/step"
    if len(ranked) > 1:
        nxt = ranked[1]
        line += f", {step_s[nxt] / step_s[best]:.2f}x faster than {nxt} ({step_s[nxt]:.3g} s)"
    return line + "."


def format_table(c: Cluster, rows: list[dict]) -> str:
    m = c.params * c.param_bytes
    lines = [f"{c.params:.3g} params, {c.nodes} nodes x {c.gpus_per_node} GPUs, inter-node "
             f"{c.inter_gbps:g} Gbit/s, intra {c.intra_gbps:g} Gbit/s, {c.tokens_per_gpu} "
             f"tokens/GPU, {c.tflops:g} TFLOP/s; M = {m / 1e9:.2f} GB",
             "| config | cross-node per node (x M) | fwd | bwd | grad | comm s | compute s | "
             "step s | speedup | hpZ GB/GPU |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['cross'] / m:.3f} | {r['fwd'] / m:.3f} | "
                     f"{r['bwd'] / m:.3f} | {r['grad'] / m:.3f} | {r['comm_s']:.3f} | "
                     f"{r['compute_s']:.3f} | {r['step_s']:.3f} | {r['speedup']:.2f}x | "
                     f"{r['secondary'] / 1e9:.2f} |")
    return "\n".join(lines)
