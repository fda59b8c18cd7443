"""Per-rank memory at real model sizes: zeropp's presets against PyTorch FSDP2, one
fresh world of W=4 ranks (2 nodes x 2 on loopback) per configuration, HF GPT-2
built from its config (no hub), AdamW, batch 1 x 128, a few steps (issue 21).

For each configuration, rank 0's resident memory (RSS) before the model is built,
its high-water mark (VmHWM) over the run and its RSS after the last step, with
`zeropp.memory_stats` for zeropp (tensor bytes by kind) and the ZeRO-3 formula
16 bytes/param / W (fp32 master, gradient, two AdamW moments) beside them. Every
rank first builds the whole model (4 bytes/param), which the peak includes.

zeropp pins glibc's mmap threshold on the CPU (src/zeropp/memory.py, [Note: host
memory that freed buffers keep]); `fsdp2+malloc` runs FSDP2 with the same setting
(zeropp.memory.release_freed_host_memory() in each rank), `fsdp2` as it comes.

    python benchmarks/memory_scale.py --model gpt2-124m --configs zero3,zeropp,zeropp-plus,fsdp2,fsdp2+malloc [--write]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch
from _report import report

import zeropp
from zeropp.deepspeed.accelerator import _proc_status_kb
from zeropp.launch import spawn
from zeropp.memory import release_freed_host_memory

MODELS = {"gpt2-124m": (12, 768), "gpt2-355m": (24, 1024)}


def _rss_mb() -> tuple[float, float]:
    return _proc_status_kb("VmRSS") / 1024, _proc_status_kb("VmHWM") / 1024


def _run(config: str, model: str, steps: int) -> dict:
    import transformers as tf
    if config == "fsdp2+malloc":
        release_freed_host_memory()  # zeropp's setting, for FSDP2 too
    base = _rss_mb()[0]
    layers, width = MODELS[model]
    torch.manual_seed(0)
    m = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64,
                                         n_positions=128))
    params = sum(p.numel() for p in m.parameters())
    if config.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard
        for block in m.transformer.h:
            fully_shard(block)
        fully_shard(m)
    else:
        zeropp.shard(m, zeropp.Config.preset(config, node_size=2))
    gc.collect()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for _ in range(steps):
        x = torch.randint(0, 50257, (1, 128), generator=g)
        m(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    seconds = (time.perf_counter() - t0) / steps
    gc.collect()
    rss, peak = _rss_mb()
    stats = zeropp.memory_stats(m, opt) if not config.startswith("fsdp2") else None
    return {"params": params, "base": base, "peak": peak, "after": rss, "stats": stats,
            "s_per_step": seconds}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2-124m", choices=list(MODELS))
    p.add_argument("--configs", default="zero3,zeropp,zeropp-plus,fsdp2,fsdp2+malloc")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    rows = ["| config | peak RSS MB | above baseline MB | RSS after steps MB | tensors held MB "
            "(memory_stats) | s/step |", "|---|---|---|---|---|---|"]
    params = None
    for config in a.configs.split(","):
        r = spawn(_run, 4, 2, args=(config, a.model, a.steps), timeout=1800)[0]
        params = r["params"]
        held = f"{r['stats']['total'] / 2**20:.0f}" if r["stats"] else "-"
        rows.append(f"| {config} | {r['peak']:.0f} | {r['peak'] - r['base']:.0f} | "
                    f"{r['after']:.0f} | {held} | {r['s_per_step']:.1f} |")
        print(rows[-1], flush=True)
    formula = 16 * params / 4 / 2**20
    head = (f"HF GPT-2 {a.model} ({params / 1e6:.1f}M params), W=4 as 2 nodes x 2 (loopback), "
            f"AdamW, batch 1x128, {a.steps} steps, rank 0; ZeRO-3 formula 16 B/param / W = "
            f"{formula:.0f} MB, the whole model built first on every rank = "
            f"{4 * params / 2**20:.0f} MB")
    cmd = "python benchmarks/memory_scale.py " + " ".join(sys.argv[1:])
    report([f"### Memory at scale: {a.model} ({time.strftime('%Y-%m-%d')})", "",
            f"Command: `{cmd}`  ", head + ".", "", *rows], a.write)


if __name__ == "__main__":
    main()
