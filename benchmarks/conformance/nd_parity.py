"""Stock FSDP2 against `zeropp.fsdp2.install` under N-D parallelism, on gloo with
N = 2 emulated nodes of D ranks (W = 2D), fp32, AdamW lr 3e-3, random bytes (2 x 32
per data-parallel rank and step), every preset:
- "tp": tensor parallel x FSDP in torchtitan's order (tests/cases.py: `TPLM`, 3 blocks
  of width 64, vocab 256, `tp_fsdp`): TP=2 inside the node (each block's up
  ColwiseParallel, down RowwiseParallel), then `fully_shard` per block and on the root
  over the "dp" mesh dimension (W/2 ranks, D/2 per node); the norms, down's bias, the
  embedding and the untied head are TP-replicated, and their shards must be bitwise
  equal on the two TP ranks of a dp index;
- "hsdp": a 3-block GPT (vocab 256, width 64, context 32) under
  `fully_shard` on a (replicate N, shard D) mesh, shard inside the node.
Per run: the first and last mean loss, the largest relative gap to stock, whether
every rank computes the same probe output (the logits' bytes) and the TP-replicated
parameters are bitwise equal (tp), or the replicas hold the same bits (hsdp), and the
cross-node bytes: zeropp's accounting summed over the ranks (FSDP2's own all-reduce
across replicas in the presets without qgZ included); for stock HSDP the ring count of
that fp32 all-reduce (not instrumented); for stock TP x FSDP the "zero3" preset's
(FSDP2's own collectives, counted).

    python benchmarks/conformance/nd_parity.py D [steps]     # D = 2: W=4, D = 4: W=8
"""
import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import zeropp
import zeropp.fsdp2
from zeropp.cli.launch import spawn
from zeropp.stats import ring_send
from zeropp.train.model import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from cases import TPLM, replicated_digest, tp_fsdp  # noqa: E402  (the tests' TP model)

PRESETS = [None, "zero3", "qwz", "hpz", "qgz", "zeropp", "zeropp-plus"]


def build(kind, d):
    w = dist.get_world_size()
    torch.manual_seed(0)
    if kind == "tp":
        m, mesh = tp_fsdp(TPLM(), w // 2)
        return m, mesh["dp"].get_local_rank()
    m = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=3, n_embd=64, n_head=2))
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
    replicated = replicated_digest(m) if kind == "tp" else None
    with torch.no_grad():  # (after which the root's weights stay gathered)
        x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(99))
        probe = hashlib.sha256(m(x, x)[0].numpy().tobytes()).hexdigest()
    shard_bytes = 4 * sum(fp.padded_sharded_param_size.numel() for mod in m.modules()
                          if hasattr(mod, "_get_fsdp_state")
                          for grp in mod._get_fsdp_state()._fsdp_param_groups
                          for fp in grp.fsdp_params)
    inter = zeropp.comm_stats(m)["inter_node_bytes"] if preset else None
    return {"losses": losses, "probe": probe, "replicated": replicated,
            "local": local.numpy().tobytes().hex(),
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
            if kind == "tp":  # rank = 2 x dp + tp
                same = len({r[name]["probe"] for r in res}) == 1 and all(
                    res[r][name]["replicated"] == res[r ^ 1][name]["replicated"]
                    for r in range(2 * d))
            else:  # replica k of shard j is rank k*d + j: all replicas' bits equal
                same = all(res[r][name]["local"] == res[r % d][name]["local"]
                           for r in range(2 * d))
            # stock HSDP: its all-reduce; a preset's accounting counts FSDP2's own (no qgZ) too
            inter = sum(r[name]["inter"] for r in res) if p else base if kind == "hsdp" else None
            out["runs"][name] = {
                "first": ls[0], "last": ls[-1],
                "max_rel_gap_to_stock": max(abs(a - b) / abs(b) for a, b in zip(ls, stock)),
                "loss_drop_vs_stock": (ls[0] - ls[-1]) / (stock[0] - stock[-1]),
                "same_outputs_and_tp_replicated_bits" if kind == "tp" else
                "replicas_bitwise_equal": same,
                "cross_node_bytes": inter,
                "vs_stock_bytes": None if inter is None else inter / base}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
