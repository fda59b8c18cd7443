"""Two source trees, the same bits? Every preset's losses (as float hex, every
step, every rank) and bytes (per collective: inter-node, intra-node, calls) for
gpt-6x256 at W=4 as 2 x 2, 6 steps of AdamW with clipping, under zeropp's engine
(`shard`) and under stock FSDP2 with `zeropp.fsdp2.install` ("fsdp2+PRESET"),
written to a JSON file; run it once per tree and compare the files (`cmp`).

    PYTHONPATH=TREE/src python benchmarks/probes/same_bits.py OUT.json TREE/benchmarks
"""
import json
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, sys.argv[2] if len(sys.argv) > 2 else "benchmarks")
from _gpt_step import batch, sharded_gpt  # noqa: E402

import zeropp  # noqa: E402
from zeropp.cli.launch import spawn  # noqa: E402

PRESETS = ["zero3", "qwz", "hpz", "qgz", "zeropp", "zeropp-plus"]


def _fsdp2_gpt(preset: str):
    """gpt-6x256 as sharded_gpt builds it, under fully_shard per block and on the root,
    with zeropp's comms installed."""
    from torch.distributed.fsdp import fully_shard

    from zeropp.fsdp2 import install
    from zeropp.train.model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=6, n_embd=256, n_head=4))
    for block in model.h:
        fully_shard(block)
    fully_shard(model)
    install(model, preset, node_size=2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def work() -> dict:
    torch.set_num_threads(1)
    out = {}
    for p in PRESETS + [f"fsdp2+{p}" for p in PRESETS]:
        fsdp2 = p.startswith("fsdp2+")
        model, opt = _fsdp2_gpt(p[6:]) if fsdp2 else sharded_gpt(p, 6, 256)
        g = torch.Generator().manual_seed(dist.get_rank())
        losses = []
        for _ in range(6):
            x = batch(g)
            loss = model(x, x)[1]
            loss.backward()
            if fsdp2:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:
                zeropp.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item().hex())
        st = zeropp.comm_stats(model)
        out[p] = {"losses": losses, "inter": st["inter_node_bytes"],
                  "intra": st["intra_node_bytes"],
                  "by_op": {k: (v["inter_node_bytes"], v["intra_node_bytes"], v["calls"])
                            for k, v in st["by_op"].items()}}
    return out


if __name__ == "__main__":
    res = spawn(work, 4, 2, timeout=1200)
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)
    for p in res[0]:
        print(p, "last loss", res[0][p]["losses"][-1], "inter-node bytes (all ranks)",
              sum(r[p]["inter"] for r in res), "intra-node", sum(r[p]["intra"] for r in res))
