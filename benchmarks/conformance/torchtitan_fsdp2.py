"""torchtitan's own FSDP2 set-up with zeropp under it: torchtitan 0.3.0's Llama 3
`debugmodel` (6 blocks, width 256, vocab 2048), built on the meta device and
sharded by torchtitan's `apply_fsdp_to_decoder` (per block, then the root; it sets
the gradient divide factor to 1.0 and the loss is summed over tokens and divided
by the global token count, as torchtitan's trainer does), torchtitan's
`CrossEntropyLoss` and `clip_grad_norm_`, AdamW; zeropp adds one line,
`zeropp.fsdp2.install(model, preset, node_size=2)`. W=4 as 2 nodes x 2 (gloo),
fp32, Shakespeare's bytes, batch 2 x 64 per rank, 60 steps.

Two changes, both forced by the CPU and neither touching what zeropp replaces:
- attention: FlexAttention has no backward on the CPU, so each block's inner
  attention is torchtitan's own ScaledDotProductAttention (causal, same weights);
- the stock baseline: the divide factor 1.0 makes FSDP2 reduce with PREMUL_SUM,
  which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo", checked below),
  so stock FSDP2 runs with its default AVG and the loss multiplied by W = 4;
  x4 then /4 is exact in binary floating point, so its gradients are the sum's.
  The installed comms run torchtitan's PREMUL_SUM as it is.

Per run: the mean loss over ranks at every step, whether one probe batch gives
the same loss on every rank, zeropp's accounted inter-node bytes (all ranks).

    pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring_parser triton
    python benchmarks/conformance/torchtitan_fsdp2.py [steps]
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.distributed.utils import clip_grad_norm_
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry

import zeropp
import zeropp.fsdp2
from zeropp.cli.launch import spawn
from zeropp.train.data import get_batch, load_text, split_tokens
from zeropp.train.tokenizer import encode

RUNS = ["stock", "zero3", "zeropp", "zeropp-plus"]
BATCH, SEQ = 2, 64


def build():
    spec = model_registry("debugmodel")
    for layer in spec.model.layers:  # FlexAttention: no backward on the CPU
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        model = spec.model.build()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32,
                          reduce_dtype=torch.float32, pp_enabled=False)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def stock_refuses_premul_sum(model, x) -> str:
    try:
        model(x, positions=torch.arange(SEQ).expand(BATCH, SEQ)).sum().backward()
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return ""


def run(preset, steps, train):
    model = build()
    world = dist.get_world_size()
    if preset == "stock":
        for m in model.modules():  # AVG instead of PREMUL_SUM (gloo has none), loss x W
            if isinstance(m, torch.distributed.fsdp.FSDPModule):
                m.set_gradient_divide_factor(float(world))
    else:
        zeropp.fsdp2.install(model, preset, node_size=2)
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    losses = []
    for _ in range(steps):
        x, y = get_batch(train, BATCH, SEQ, gen)
        tokens = torch.tensor(float(y.numel()))
        dist.all_reduce(tokens)  # torchtitan's global_valid_tokens
        loss, _ = loss_fn(model(x, positions=pos), y, tokens)
        (loss * world if preset == "stock" else loss).backward()
        clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)  # each rank's loss is its share of the global mean
        losses.append(t.item())
    with torch.no_grad():
        x, y = get_batch(train, BATCH, SEQ, torch.Generator().manual_seed(99))
        probe = loss_fn(model(x, positions=pos), y)[0].item()
    inter = zeropp.comm_stats(model)["inter_node_bytes"] if preset != "stock" else None
    return losses, probe, inter


def work(steps, tokens):
    torch.set_num_threads(1)
    train, _ = split_tokens(torch.load(tokens, weights_only=True), SEQ)
    x, _ = get_batch(train, BATCH, SEQ, torch.Generator().manual_seed(0))
    refused = stock_refuses_premul_sum(build(), x)
    return {"refused": refused, **{p: run(p, steps, train) for p in RUNS}}


if __name__ == "__main__":
    import tempfile
    from pathlib import Path
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    ids, _ = encode(load_text(None), "bytes", Path(tempfile.gettempdir()))
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(ids, f"{tmp}/tokens.pt")
        res = spawn(work, 4, 2, args=(steps, f"{tmp}/tokens.pt"), timeout=3000)
    print(f"stock FSDP2 with torchtitan's divide factor 1.0 on gloo: {res[0]['refused']!r}")
    stock = res[0]["stock"][0]
    zero3 = sum(r["zero3"][2] for r in res)
    drop = stock[0] - sum(stock[-5:]) / 5
    for p in RUNS:
        losses = res[0][p][0]
        same = len({r[p][1] for r in res}) == 1
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, stock))
        mine = (losses[0] - sum(losses[-5:]) / 5) / drop
        inter = sum(r[p][2] for r in res) if p != "stock" else None
        ratio = f", {inter / zero3:.4f}x zero3" if inter is not None else ""
        print(f"{p:12s} loss {losses[0]:.5f} -> {losses[-1]:.5f} (last 5: "
              f"{sum(losses[-5:]) / 5:.5f}); max rel. gap to stock {rel:.2e}; loss drop "
              f"{100 * mine:.1f}% of stock's; same probe on every rank: {same}; "
              f"inter-node bytes {inter}{ratio}")
