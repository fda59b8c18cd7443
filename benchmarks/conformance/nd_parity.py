"""Stock FSDP2 against `zeropp.fsdp2.install` under N-D parallelism, on gloo with
N = 2 emulated nodes of D ranks (W = 2D), fp32, AdamW lr 3e-3, a 3-block GPT (vocab
256, width 64, context 32), random bytes (2 x 32 per data-parallel rank and step):
- "tp": tensor parallel x FSDP in torchtitan's order: TP=2 inside the node (each
  MLP's fc ColwiseParallel, proj RowwiseParallel), then `fully_shard` per block and
  on the root over the "dp" mesh dimension (W/2 ranks, D/2 per node);
- "hsdp": `fully_shard` on a (replicate N, shard D) mesh, shard inside the node.
Per run: the first and last mean loss, the largest relative gap to stock, whether
every rank computes the same probe loss (tp) or the replicas hold the same bits
(hsdp), and the cross-node bytes: zeropp's accounting summed over the ranks; for
stock HSDP (and "zero3" on HSDP, which leaves it) the ring count of FSDP2's fp32
all-reduce across replicas (not instrumented); for stock TP x FSDP the "zero3"
preset's (FSDP2's own collectives, counted).

    python benchmarks/conformance/nd_parity.py D [steps]     # D = 2: W=4, D = 4: W=8
"""
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import zeropp
import zeropp.fsdp2
from zeropp.cli.launch import spawn
from zeropp.stats import ring_send
from zeropp.train.model import GPT, GPTConfig

PRESETS = [None, "zero3", "zeropp", "zeropp-plus"]


def build(kind, d):
    w = dist.get_world_size()
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=3, n_embd=64, n_head=2))
    if kind == "tp":
        mesh = init_device_mesh("cpu", (w // 2, 2), mesh_dim_names=("dp", "tp"))
        for b in m.h:
            parallelize_module(b.mlp, mesh["tp"], {"fc": ColwiseParallel(),
                                                   "proj": RowwiseParallel()})
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(m, mesh=mesh["dp"])
        return m, mesh["dp"].get_local_rank()
    mesh = init_device_mesh("cpu", (w // d, d), mesh_dim_names=("replicate", "shard"))
    for b in m.h:
        fully_shard(b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, dist.get_rank()


def run(kind, preset, d, steps):
    m, data_rank = build(kind, d)
    if preset:
        zeropp.fsdp2.install(m, preset, node_size=d)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(data_rank)
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
    local = torch.cat([p.to_local().detach().reshape(-1) for p in m.parameters()])
    with torch.no_grad():  # (after which the root's weights stay gathered)
        x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(99))
        probe = m(x, x)[1].item()
    shard_bytes = 4 * sum(fp.padded_sharded_param_size.numel() for mod in m.modules()
                          if hasattr(mod, "_get_fsdp_state")
                          for grp in mod._get_fsdp_state()._fsdp_param_groups
                          for fp in grp.fsdp_params)
    inter = zeropp.comm_stats(m)["inter_node_bytes"] if preset else None
    return {"losses": losses, "probe": probe, "local": local.numpy().tobytes().hex(),
            "inter": inter, "stock_allreduce": ring_send(shard_bytes, dist.get_world_size() // d,
                                                         2) * steps}


def work(d, steps):
    torch.set_num_threads(1)
    return {f"{k}/{p or 'stock'}": run(k, p, d, steps) for k in ("tp", "hsdp") for p in PRESETS}


def main():
    d = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 50
    res = spawn(work, 2 * d, d, args=(d, steps), timeout=3000)
    out = {"world": 2 * d, "node_size": d, "steps": steps, "runs": {}}
    for kind in ("tp", "hsdp"):
        stock = res[0][f"{kind}/stock"]["losses"]
        if kind == "tp":
            base = sum(r["tp/zero3"]["inter"] for r in res)
        else:
            base = sum(r["hsdp/stock"]["stock_allreduce"] for r in res)
        for p in PRESETS:
            name = f"{kind}/{p or 'stock'}"
            ls = res[0][name]["losses"]
            if kind == "tp":
                same = len({r[name]["probe"] for r in res}) == 1
            else:  # replica k of shard j is rank k*d + j: all replicas' bits equal
                same = all(res[r][name]["local"] == res[r % d][name]["local"]
                           for r in range(2 * d))
            inter = sum(r[name]["inter"] for r in res) if p else None
            if kind == "hsdp" and p in (None, "zero3"):  # FSDP2's own all-reduce, as stock's
                inter = base + (inter or 0)
            out["runs"][name] = {
                "first": ls[0], "last": ls[-1],
                "max_rel_gap_to_stock": max(abs(a - b) / abs(b) for a, b in zip(ls, stock)),
                "loss_drop_vs_stock": (ls[0] - ls[-1]) / (stock[0] - stock[-1]),
                "same_on_every_rank" if kind == "tp" else "replicas_bitwise_equal": same,
                "cross_node_bytes": inter,
                "vs_stock_bytes": None if inter is None else inter / base}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
