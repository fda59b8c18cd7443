"""torchtitan's own N-D parallelism with zeropp's comms under it, W=4 as 2 nodes x 2
(gloo), fp32, torchtitan's `ParallelDims`, its parallelize function, `CrossEntropyLoss`
and `clip_grad_norm_`, AdamW; zeropp adds one line,
`zeropp.fsdp2.install(model, preset, node_size=2)`:
- tp: the Llama 3 `debugmodel` (6 blocks, width 256, vocab 2048) under
  `parallelize_llama` with tensor parallel 2 (inside the node) x FSDP 2 (one rank per
  node);
- moe: the Qwen3 `debugmodel_moe` (64 experts, top 8, width 256; its first 2 of 8
  blocks, for the CPU's sake) under `parallelize_qwen3` with expert parallel 2 (inside
  the node): the dense part under FSDP over all 4 ranks, the experts under FSDP over
  the 2 ranks of the "efsdp" mesh (one per node), one `fully_shard` per block with
  per-parameter meshes (two FSDP parameter groups);
- moe-noep: the same model without expert parallelism (experts under FSDP over all 4
  ranks, with the rest of their block).
The MoE modes add `stock-ulp`: stock with every gradient nudged by about an ulp (the
loss x (1 + 2^-23)), what a different summation order does; how far it drifts from
stock is the MoE's own sensitivity, against which zero3's gap reads.
The sharding configs are set as torchtitan's Trainer sets them before the build
(`set_llama3_sharding_config` / `set_qwen3_sharding_config`; its own
`update_from_config` would import the Trainer, with tensorboard and torchdata).
Built on the meta device; Shakespeare's bytes, batch 2 x 64 per data-parallel rank (the
TP ranks of one read the same), the loss summed over tokens and divided by the global
token count.

The CPU forces the changes torchtitan_fsdp2.py describes (SDPA for FlexAttention;
stock FSDP2 reduces with SUM, then / dp, and the loss x dp, as gloo has no PREMUL_SUM), and one
more: ParallelDims builds its mesh on "cpu" (torchtitan takes "cuda" when it finds no
accelerator).

    pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring_parser triton
    python benchmarks/conformance/torchtitan_nd.py tp [steps]    # Llama 3, TP 2 x FSDP 2
    python benchmarks/conformance/torchtitan_nd.py moe [steps]   # Qwen3 MoE, EP 2, FSDP 4
    python benchmarks/conformance/torchtitan_nd.py moe-noep [steps]
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.utils import clip_grad_norm_
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.parallelize import parallelize_llama
from torchtitan.models.llama3.sharding import set_llama3_sharding_config
from torchtitan.models.qwen3 import model_registry as qwen3_registry
from torchtitan.models.qwen3.parallelize import parallelize_qwen3
from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

import zeropp
import zeropp.fsdp2
from zeropp.cli.launch import spawn
from zeropp.train.data import get_batch, load_text, split_tokens
from zeropp.train.tokenizer import encode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from cases import replicated_digest  # noqa: E402  (the tests' digest of TP-replicated shards)

RUNS = ["stock", "zero3", "zeropp", "zeropp-plus"]
BATCH, SEQ, TP, EP, MOE_LAYERS = 2, 64, 2, 2, 2


def build(mode):
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import utils as dist_utils
    parallel_dims.device_type = "cpu"  # torchtitan takes "cuda" when it finds no accelerator
    dist_utils.set_spmd_backend("partial_dtensor")  # as torchtitan's Trainer sets it
    world = dist.get_world_size()
    tp, ep = (TP, 1) if mode == "tp" else (1, EP if mode == "moe" else 1)
    dims = ParallelDims(dp_replicate=1, dp_shard=world // tp, cp=1, tp=tp, pp=1, ep=ep,
                        world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    if mode == "tp":
        spec = model_registry("debugmodel")
        for layer in spec.model.layers:  # FlexAttention: no backward on the CPU
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
        parallelize = parallelize_llama
    else:
        spec = qwen3_registry("debugmodel_moe")
        spec.model.layers = spec.model.layers[:MOE_LAYERS]
        for layer in spec.model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
        parallelize = parallelize_qwen3
    training = TrainingConfig(mixed_precision_param="float32",
                              mixed_precision_reduce="float32")
    parallelism = ParallelismConfig(data_parallel_shard_degree=world // tp,
                                    tensor_parallel_degree=tp, expert_parallel_degree=ep,
                                    spmd_backend="partial_dtensor")
    # the TP and EP sharding configs, as the Trainer's update_from_config sets them (its
    # own call imports the Trainer, with tensorboard and torchdata)
    if mode == "tp":
        set_llama3_sharding_config(spec.model, enable_sp=False)
    else:
        set_qwen3_sharding_config(spec.model, enable_sp=False, enable_ep=ep > 1)
    with torch.device("meta"):
        model = spec.model.build()
    parallelize(model, parallel_dims=dims, training=training, parallelism=parallelism,
                compile_config=CompileConfig(enable=False), ac_config=None,
                dump_folder="/tmp")
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model, dims


def run(mode, preset, steps, train):
    model, dims = build(mode)
    dp = dims.get_mesh("fsdp")
    if preset.startswith("stock"):
        for m in model.modules():  # SUM, then / dp (gloo has no PREMUL_SUM), loss x dp
            if isinstance(m, torch.distributed.fsdp.FSDPModule):
                m.set_gradient_divide_factor(float(dp.size()))
                m.set_force_sum_reduction_for_comms(True)
    else:
        zeropp.fsdp2.install(model, preset, node_size=2)
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(dp.get_local_rank())
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    losses = []
    for _ in range(steps):
        x, y = get_batch(train, BATCH, SEQ, gen)
        tokens = torch.tensor(float(y.numel()))
        dist.all_reduce(tokens, group=dp.get_group())  # torchtitan's global_valid_tokens
        loss, _ = loss_fn(model(x, positions=pos), y, tokens)
        # stock-ulp: every gradient off stock's by about an ulp, as a summation order would
        nudge = 1 + 2 ** -23 if preset == "stock-ulp" else 1
        (loss * nudge * dp.size() if preset.startswith("stock") else loss).backward()
        clip_grad_norm_(list(model.parameters()), 1.0, foreach=True, ep_enabled=dims.ep_enabled)
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t, group=dp.get_group())  # each dp rank's share of the global mean
        losses.append(t.item())
    digest = replicated_digest(model)  # (before the probe: the root stays gathered after it)
    with torch.no_grad():
        x, y = get_batch(train, BATCH, SEQ, torch.Generator().manual_seed(99))
        probe = loss_fn(model(x, positions=pos), y)[0].item()
    inter = None if preset.startswith("stock") else zeropp.comm_stats(model)["inter_node_bytes"]
    return losses, probe, inter, digest



def work(mode, preset, steps, tokens):
    torch.set_num_threads(1)
    train, _ = split_tokens(torch.load(tokens, weights_only=True), SEQ)
    return run(mode, preset, steps, train)


if __name__ == "__main__":
    import tempfile
    mode = sys.argv[1] if len(sys.argv) > 1 else "tp"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 50
    runs = RUNS + (["stock-ulp"] if mode != "tp" else [])
    ids, _ = encode(load_text(None), "bytes", Path(tempfile.gettempdir()))
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(ids, f"{tmp}/tokens.pt")
        # a world per run: the MoE runs' host memory grows with each step on the CPU
        # (stock's too), and a process does not give it back between runs
        res = {p: spawn(work, 4, 2, args=(mode, p, steps, f"{tmp}/tokens.pt"), timeout=3000)
               for p in runs}
    stock = res["stock"][0][0]
    zero3 = sum(r[2] for r in res["zero3"])
    drop = stock[0] - sum(stock[-5:]) / 5
    for p in runs:
        losses = res[p][0][0]
        # the probe per TP rank (each computes its vocabulary shard's part of the loss):
        # the same on every data-parallel rank at each TP index
        tp = TP if mode == "tp" else 1
        same = all(res[p][r][1] == res[p][r % tp][1] for r in range(len(res[p])))
        # rank = dp * tp + tp index: the TP ranks of one dp index hold one model
        whole = all(res[p][r][3] == res[p][r - r % tp][3] for r in range(len(res[p])))
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, stock))
        mine = (losses[0] - sum(losses[-5:]) / 5) / drop
        inter = sum(r[2] for r in res[p]) if not p.startswith("stock") else None
        ratio = f", {inter / zero3:.4f}x zero3" if inter is not None else ""
        print(f"{p:12s} loss {losses[0]:.5f} -> {losses[-1]:.5f} (last 5: "
              f"{sum(losses[-5:]) / 5:.5f}); max rel. gap to stock {rel:.2e} (step 2: "
              f"{abs(losses[1] - stock[1]) / stock[1]:.1e}); loss drop {100 * mine:.1f}% of "
              f"stock's; same probe on every dp rank: {same}; TP-replicated parameters bitwise "
              f"equal on every TP rank: {whole}; inter-node bytes {inter}{ratio}")
