"""Stock FSDP2 against FSDP2 with `zeropp.fsdp2.install` over a long run: the final
validation loss per configuration, one seed per call (same seed: same initial
weights and data order in every configuration), in the layout
`benchmarks/accuracy.py --base fsdp2` reads.

The loop is plain FSDP2 as torchtitan writes it (`fully_shard` per block, then the
root; AdamW; warmup + cosine; `clip_grad_norm_` on the DTensor gradients); a
`fsdp2+PRESET` configuration adds the one `install` line. The settings are those of
the engine's accuracy runs (RESULTS, "Accuracy: zeropp-plus against ZeRO-3"): GPT
`small` on Shakespeare's bytes, W=4 as 2 nodes x 2 (gloo), batch 4 x 64 per rank.

    for s in 0 1 2; do python benchmarks/fsdp2_accuracy.py --seed $s \\
        --out runs/fsdp2_acc/seed$s; done
    python benchmarks/accuracy.py --base fsdp2 runs/fsdp2_acc/seed{0,1,2}

Tensor parallel x FSDP (TP 2 inside the node on each MLP, FSDP over the dp mesh; a TP
pair reads one batch): `--configs fsdp2-tp,fsdp2-tp+zeropp-plus`, then
`benchmarks/accuracy.py --base fsdp2-tp ...`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import zeropp
import zeropp.fsdp2
from zeropp.cli.launch import spawn
from zeropp.train.data import get_batch, load_text, split_tokens
from zeropp.train.loop import TrainArgs, _val_loss, lr_at
from zeropp.train.model import GPT, PRESETS, GPTConfig
from zeropp.train.tokenizer import encode

CONFIGS = ["fsdp2", "fsdp2+zeropp", "fsdp2+zeropp-plus"]


def worker(config: str, a: TrainArgs, tokens: str, node_size: int) -> dict:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    train, val = split_tokens(torch.load(tokens, weights_only=True), a.seq_len)
    torch.manual_seed(a.seed)
    model = GPT(GPTConfig(vocab_size=256, block_size=a.seq_len, **PRESETS[a.model]))
    base, _, preset = config.partition("+")
    mesh, data_rank = None, rank
    if base == "fsdp2-tp":  # TP 2 inside the node on each MLP, then FSDP over "dp"
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
        tp_dp = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.h:
            parallelize_module(block.mlp, tp_dp["tp"], {"fc": ColwiseParallel(),
                                                        "proj": RowwiseParallel()})
        mesh, data_rank = tp_dp["dp"], tp_dp["dp"].get_local_rank()  # a TP pair: one batch
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if preset:
        zeropp.fsdp2.install(model, preset, node_size=node_size)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay,
                            betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(a.seed * 1000 + data_rank)
    inter, evals, t0 = 0.0, [], time.perf_counter()
    for step in range(a.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a)
        if preset:
            zeropp.reset_comm_stats(model)
        x, y = get_batch(train, a.batch, a.seq_len, gen)
        _, loss = model(x, y)
        loss.backward()
        if mesh is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        else:  # gradients on two meshes (dp x tp, dp), which torch's clip cannot stack
            _clip_across_meshes(model, a.clip)
        opt.step()
        opt.zero_grad()
        if preset:  # this step's bytes (an evaluation's refresh not counted)
            inter += zeropp.comm_stats(model)["inter_node_bytes"]
        if (step + 1) % a.eval_every == 0 or step == a.steps - 1:
            evals.append((step + 1, _val_loss(model, val, a, data_rank, world)))
    per_node = torch.zeros(world // node_size, dtype=torch.float64)
    per_node[rank // node_size] = inter / a.steps
    dist.all_reduce(per_node)
    return {"final_val_loss": evals[-1][1], "val_losses": evals,
            "train_loss_last": loss.item(), "seconds": time.perf_counter() - t0,
            "inter_node_MB_per_step": per_node.max().item() / 1e6 if preset else None}


def _clip_across_meshes(model, max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_'s rule over DTensor gradients on different meshes:
    the total 2-norm from each gradient's own (full) norm."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = sum(g.norm().full_tensor().double() ** 2 for g in grads) ** 0.5
    dist.broadcast(total, src=0)  # one coefficient everywhere (DTensor's norms may differ in ulps)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", required=True)
    a = p.parse_args()
    args = TrainArgs(steps=a.steps, model="small", seq_len=64, batch=4, eval_every=250,
                     eval_batches=32, seed=a.seed)
    ids, _ = encode(load_text(None), "bytes", Path(tempfile.gettempdir()))
    with tempfile.TemporaryDirectory() as tmp:
        tokens = str(Path(tmp) / "tokens.pt")
        torch.save(ids, tokens)
        for config in a.configs.split(","):
            res = spawn(worker, 4, 2, args=(config, args, tokens, 2), timeout=7200)[0]
            d = Path(a.out) / config
            d.mkdir(parents=True, exist_ok=True)
            (d / "summary.json").write_text(json.dumps(res, indent=1))
            print(f"seed {a.seed} {config}: final val {res['final_val_loss']:.4f} "
                  f"({res['seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
