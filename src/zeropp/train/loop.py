"""The training loop each worker runs: plain PyTorch around zeropp.shard."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist

import zeropp

from .data import get_batch, load_tokens
from .model import GPT, GPTConfig


@dataclass
class TrainArgs:
    steps: int = 100
    batch: int = 8            # sequences per rank per step
    seq_len: int = 64
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    lr: float = 3e-3
    warmup: int = 5
    clip: float = 1.0
    seed: int = 0
    data: Optional[str] = None
    eval_every: int = 25


def lr_at(step: int, a: TrainArgs) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _mean_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _bytes_per_node(model: torch.nn.Module, topo: zeropp.Topology) -> torch.Tensor:
    """[inter, intra] bytes each node sent since the last reset, summed over its ranks."""
    s = zeropp.comm_stats(model)
    t = torch.zeros(topo.num_nodes, 2, dtype=torch.float64)
    t[topo.node] = torch.tensor([s["inter_node_bytes"], s["intra_node_bytes"]], dtype=torch.float64)
    dist.all_reduce(t)
    return t


@torch.no_grad()
def _val_loss(model, val, a: TrainArgs, rank: int) -> float:
    gen = torch.Generator().manual_seed(10_000 + rank)
    losses = [model(*get_batch(val, a.batch, a.seq_len, gen))[1].item() for _ in range(4)]
    return _mean_over_ranks(sum(losses) / len(losses))


def train_worker(a: TrainArgs, cfg: zeropp.Config) -> dict:
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *_, **__: None)
    train_data, val = load_tokens(a.data, a.seq_len)
    torch.manual_seed(a.seed)  # same initial weights on every rank
    model = GPT(GPTConfig(vocab_size=256, block_size=a.seq_len, n_layer=a.n_layer,
                          n_head=a.n_head, n_embd=a.n_embd))
    n_params = sum(p.numel() for p in model.parameters())
    zeropp.shard(model, cfg)
    topo = model._zeropp_state.topo
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(a.seed * 1000 + rank)  # each rank its own rows
    M = n_params * 4  # fp32 bytes
    zero3 = 3 * (topo.world_size - 1) / topo.world_size * M
    say(f"GPT {n_params / 1e6:.2f}M params, {topo.world_size} ranks = {topo.num_nodes} nodes "
        f"x {topo.node_size}; ZeRO-3 analytic inter-node bytes per node per step: "
        f"{zero3 / 1e6:.2f} MB ({asdict(a)})")
    say(f"{'step':>5} {'loss':>7} {'lr':>8} {'norm':>6} {'s/step':>7} "
        f"{'inter-node MB/node':>19} {'intra-node MB/node':>19}")
    history = []
    for step in range(a.steps):
        t0 = time.perf_counter()
        zeropp.reset_comm_stats(model)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a)
        x, y = get_batch(train_data, a.batch, a.seq_len, gen)
        _, loss = model(x, y)
        loss.backward()
        norm = zeropp.clip_grad_norm_(model, a.clip)
        if torch.isfinite(norm):
            opt.step()
        opt.zero_grad()
        sent = _bytes_per_node(model, topo)
        dt = time.perf_counter() - t0
        loss_g = _mean_over_ranks(loss.item())
        inter, intra = sent[:, 0].mean().item(), sent[:, 1].mean().item()
        history.append({"step": step, "loss": loss_g, "inter_node_bytes": inter,
                        "intra_node_bytes": intra, "step_time": dt})
        say(f"{step:5d} {loss_g:7.4f} {lr_at(step, a):8.2e} {norm.item():6.3f} {dt:7.2f} "
            f"{inter / 1e6:19.2f} {intra / 1e6:19.2f}")
        if a.eval_every and (step + 1) % a.eval_every == 0:
            say(f"      val loss {_val_loss(model, val, a, rank):.4f}")
    return {"history": history, "n_params": n_params, "zero3_inter_node_bytes": zero3}
