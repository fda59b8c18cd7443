"""One configuration of `zeropp bench` on one rank (started inside its node's
namespace with torchrun's environment, bench/run.py). Rank 0 writes the result
JSON; each node's first rank reads its own link's byte counters, which inside the
namespace are that node's."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zeropp
from zeropp.bench.cluster import link_counters
from zeropp.config import is_named, named
from zeropp.train.model import GPT, PRESETS, GPTConfig

FSDP = ("fsdp2", "fsdp2-hsdp", "fsdp2-tp")  # stock FSDP2: 1-D, HSDP, TP (2) x FSDP


def fsdp2_parts(name: str) -> tuple[str, str]:
    """("fsdp2-tp", "zeropp") for "fsdp2-tp+zeropp"; ("", "") for a name that is neither
    a stock FSDP2 layout nor one with a zeropp preset installed."""
    base, _, preset = name.partition("+")
    if base in FSDP and (not preset or is_named(preset)):
        return base, preset
    return "", ""
DEEPSPEED = ("deepspeed-zero3", "deepspeed-hpz")  # real DeepSpeed, the optional extra [bench]


def link_bytes() -> tuple[int, int]:
    """(rx, tx) of cl0 in this namespace ((0, 0) outside an emulated node)."""
    return link_counters(Path("/proc/net/dev").read_text()) or (0, 0)


def host_cpu() -> list[int]:
    """The machine's CPU time so far, in clock ticks: user (with nice), system,
    irq + softirq (the kernel's network work, charged to no process), idle; empty
    where /proc/stat is missing."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    except (OSError, ValueError, IndexError):
        return []
    return [f[0] + f[1], f[2], f[5] + f[6], f[3]]


def build(name: str, a, node_size: int, nodes: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=a.seq_len, **PRESETS[a.model]))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    base, preset = fsdp2_parts(name)
    if base:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        mesh = None
        if base == "fsdp2-hsdp":
            mesh = init_device_mesh("cpu", (nodes, node_size), mesh_dim_names=("replicate", "shard"))
        elif base == "fsdp2-tp":  # torchtitan's order: TP inside the node, then FSDP on dp
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )
            world = nodes * node_size
            tp_dp = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
            for block in model.h:
                parallelize_module(block.mlp, tp_dp["tp"], {"fc": ColwiseParallel(),
                                                            "proj": RowwiseParallel()})
            mesh = tp_dp["dp"]
        for block in model.h:
            fully_shard(block, mp_policy=mp, mesh=mesh)
        fully_shard(model, mp_policy=mp, mesh=mesh)
        # Each block's gather goes out while the one before it computes (stock and
        # zeropp's comms alike): on the CPU, FSDP2 prefetches forward only when told.
        blocks = list(model.h)
        for m, nxt in zip([model, *blocks], blocks):
            m.set_modules_to_forward_prefetch([nxt])
        if preset:  # zeropp's comms under stock FSDP2
            from zeropp.fsdp2 import install
            install(model, named(preset, node_size))
        return model
    if name in DEEPSPEED:
        return _deepspeed(model, name, a, node_size, dtype)
    return zeropp.shard(model, named(name, node_size,
                                     param_dtype=None if dtype == torch.float32 else dtype))


def _deepspeed(model, name: str, a, node_size: int, dtype):
    """DeepSpeed's own ZeRO-3 engine on the same model, data and optimizer (torch's
    AdamW); hpZ as `zero_hpz_partition_size` = the node size. DeepSpeed fetches
    per module with its own prefetch buckets (it has no units to set). Its qwZ
    and qgZ need CUDA kernels and do not run on CPU."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    import deepspeed
    zo = {"stage": 3, "overlap_comm": True}
    if name == "deepspeed-hpz":
        zo["zero_hpz_partition_size"] = node_size
    cfg = {"train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": zo, "steps_per_print": 1 << 30,
           "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at 1.0 by default; zeropp's rows do not clip
           "bf16": {"enabled": dtype == torch.bfloat16}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    return engine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True,
                   help="fsdp2, fsdp2-hsdp, fsdp2-tp, each +PRESET, or a zeropp preset")
    p.add_argument("--model", default="gpt-6x384")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--node-size", type=int, default=None,
                   help="ranks per node (default LOCAL_WORLD_SIZE, as torchrun sets it)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    base, preset = fsdp2_parts(a.config)
    fsdp2_zeropp = bool(preset)
    if not base and a.config not in DEEPSPEED and not is_named(a.config):
        p.error(f"unknown configuration {a.config!r}")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    node_size = a.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = world // node_size
    n_params = sum(p.numel() for p in GPT(GPTConfig(vocab_size=256, block_size=a.seq_len,
                                                    **PRESETS[a.model])).parameters())
    model = build(a.config, a, node_size, nodes)
    ours = is_named(a.config) or fsdp2_zeropp  # zeropp's comms: instrumented (comm_stats)
    engine = a.config in DEEPSPEED
    # foreach: torch's default for CUDA tensors. On the CPU the default is a loop over the
    # parameters: FSDP2's per-parameter DTensors step in 0.11 s at gpt-6x384 (W=4), 0.04 s
    # with foreach (the engine's few flat shards: 0.02 to 0.03 s either way). The emulated
    # cluster steps as a GPU one would.
    opt = None if engine else torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    data_rank = rank // 2 if base == "fsdp2-tp" else rank  # a TP pair reads one batch
    x = torch.randint(0, 256, (a.batch, a.seq_len),
                      generator=torch.Generator().manual_seed(data_rank))

    def step() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(x, x)[1]
        t1 = time.perf_counter()
        if engine:
            model.backward(loss)
            t2 = time.perf_counter()
            model.step()  # DeepSpeed's step zeroes the gradients itself
        else:
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
        dist.barrier()
        t3 = time.perf_counter()
        return t3 - t0, loss.item(), (t1 - t0, t2 - t1, t3 - t2)

    step()  # warm-up: learns unit order, builds groups and connections
    if ours:
        zeropp.reset_comm_stats(model)
    rx0, tx0 = link_bytes()
    cpu0 = host_cpu()
    times, losses, phases = zip(*(step() for _ in range(a.steps)))
    cpu1 = host_cpu()
    rx1, tx1 = link_bytes()  # the barriers add a few hundred bytes
    first = int(os.environ.get("LOCAL_RANK", 0)) == 0  # counters are per node
    stats = zeropp.comm_stats(model) if ours else {}
    acct, intra = stats.get("inter_node_bytes", 0), stats.get("intra_node_bytes", 0)
    # The forward's share: its weight gathers (all other traffic is the backward's)
    fwd = sum(v["inter_node_bytes"] for k, v in stats.get("by_op", {}).items()
              if k.startswith("all_gather/forward"))
    local = torch.tensor([(rx1 - rx0) * first, (tx1 - tx0) * first, acct, intra,
                          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, fwd],
                         dtype=torch.float64)
    every = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(every, local)
    if rank == 0:
        def node_sum(i: int, m: int) -> float:  # node m's sum over its ranks, per step
            return sum(every[r][i].item()
                       for r in range(m * node_size, (m + 1) * node_size)) / a.steps

        def node_max(i: int) -> float:  # the busiest node's
            return max(node_sum(i, m) for m in range(nodes))
        # the forward's bytes of the node that sends most, so the share is one node's
        busiest = max(range(nodes), key=lambda m: node_sum(2, m))
        Path(a.out).write_text(json.dumps({
            "config": a.config, "median_step_s": statistics.median(times), "times": times,
            "final_loss": losses[-1],
            # rank 0's forward / backward / optimizer+barrier seconds, per step
            "phases_s": phases, "world": world, "nodes": nodes, "node_size": node_size,
            "params": n_params,
            "wire_rx_tx_bytes_per_node_step": node_max(0) + node_max(1),
            "wire_tx_bytes_per_node_step": node_max(1),
            # what a node sends across, by zeropp's accounting: compare with tx
            "accounted_inter_bytes_per_node_step": node_max(2) if ours else None,
            "accounted_intra_bytes_per_node_step": node_max(3) if ours else None,
            "accounted_forward_inter_bytes_per_node_step": node_sum(5, busiest) if ours else None,
            "peak_rss_mb": max(t[4].item() for t in every) / 1024,
            # the whole machine's CPU seconds per timed step (the emulated cluster's
            # nodes share it): user, system, irq + softirq, idle
            "host_cpu_s_per_step": [(b - x) / os.sysconf("SC_CLK_TCK") / a.steps
                                    for x, b in zip(cpu0, cpu1)] or None}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
