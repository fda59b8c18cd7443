"""Stock FSDP2 against `zeropp.fsdp2.install` on the same script: a 4-block GPT
(vocab 256, width 64, context 32), `fully_shard` per block and on the root,
AdamW lr 3e-3, fp32, 40 steps of random bytes (2 x 32 per rank and step), W=4 as
2 nodes x 2 on gloo. Per run: the mean loss over ranks every 3rd step, whether a
probe batch gives the same loss on every rank, and zeropp's accounted inter-node
bytes summed over the ranks (stock FSDP2 is not instrumented).

    python benchmarks/conformance/fsdp2_parity.py [steps]
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import zeropp
import zeropp.fsdp2
from zeropp.cli.launch import spawn
from zeropp.train.model import GPT, GPTConfig

RUNS = [None, "zero3", "zeropp", "zeropp-plus"]


def build():
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_embd=64, n_head=2))
    for b in m.h:
        fully_shard(b)
    fully_shard(m)
    return m


def run(preset, steps):
    m = build()
    if preset:
        zeropp.fsdp2.install(m, preset, node_size=2)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 32), generator=g)
        loss = m(x, x)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    with torch.no_grad():
        x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(99))
        probe = m(x, x)[1].item()
    return losses, probe, zeropp.comm_stats(m)["inter_node_bytes"] if preset else None


def work(steps):
    torch.set_num_threads(1)
    return {str(p): run(p, steps) for p in RUNS}


if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    res = spawn(work, 4, 2, args=(steps,), timeout=900)
    zero3 = sum(r["zero3"][2] for r in res)
    for p in map(str, RUNS):
        losses = res[0][p][0]
        same = len({r[p][1] for r in res}) == 1
        inter = sum(r[p][2] for r in res) if p != "None" else None
        name = "stock FSDP2" if p == "None" else f"install({p!r})"
        ratio = f", {inter / zero3:.4f}x zero3" if inter is not None else ""
        print(f"{name:24s} loss {losses[0]:.5f} -> {losses[-1]:.5f}; same probe on every rank: "
              f"{same}; inter-node bytes {inter}{ratio}")
