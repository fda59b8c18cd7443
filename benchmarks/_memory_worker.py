"""One rank of a memory measurement (run under torchrun by memory_scale.py and
largest_model.py): build an HF model from its config, shard it with one framework,
train a few steps of AdamW, and report this rank's resident memory. It imports
zeropp only for zeropp's configurations, so DeepSpeed's runs use a Python that has
DeepSpeed and not zeropp.

    torchrun --nproc-per-node 4 benchmarks/_memory_worker.py --model gpt2-355m \\
        --framework zero3 --init sharded --steps 2 --tokens 128

Frameworks: a zeropp preset (zero3, zeropp, zeropp-plus), fsdp2, deepspeed, or
`unsharded` (one process, plain AdamW). Init `sharded`: the model is never whole in
a rank (zeropp.deferred_init; FSDP2's meta device + to_empty + init_weights;
DeepSpeed's zero.Init through HfDeepSpeedConfig, as Trainer does); `whole`: every
rank builds the whole model first. Rank 0 prints one line `RESULT {json}` with
every rank's peak.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import time

import torch
import torch.distributed as dist


def status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def hf_config(model: str, tokens: int):
    import transformers as tf
    if model.startswith("gpt2-"):
        layers, width = {"gpt2-124m": (12, 768), "gpt2-355m": (24, 1024),
                         "gpt2-774m": (36, 1280)}[model]
        return tf.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64,
                             n_positions=max(tokens, 128))
    if model.startswith("llama:"):  # TinyLlama-1.1B's shape at any depth
        return tf.LlamaConfig(num_hidden_layers=int(model.split(":")[1]), hidden_size=2048,
                              intermediate_size=5632, num_attention_heads=32,
                              num_key_value_heads=4, vocab_size=32000,
                              max_position_embeddings=2048, tie_word_embeddings=False)
    raise SystemExit(f"unknown model {model!r}: gpt2-124m, gpt2-355m, gpt2-774m, llama:LAYERS")


def n_params(cfg) -> int:
    import transformers as tf
    with torch.device("meta"):
        m = tf.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in m.parameters())


def blocks_of(model) -> list:
    """The repeated transformer blocks (each one unit under every framework here)."""
    base = model.base_model
    return list(base.layers if hasattr(base, "layers") else base.h)


def largest_unit_mb(cfg) -> float:
    """The full weights of the largest unit: one block, or the root (everything
    outside the blocks: embeddings, final norm, an untied head), which ZeRO-3 holds
    gathered at one time besides its shards."""
    import transformers as tf
    with torch.device("meta"):
        m = tf.AutoModelForCausalLM.from_config(cfg)
    in_blocks = {id(p) for b in blocks_of(m) for p in b.parameters()}
    root = sum(p.numel() for p in m.parameters() if id(p) not in in_blocks)
    block = max(sum(p.numel() for p in b.parameters()) for b in blocks_of(m))
    return 4 * max(root, block) / 2**20


def activations_mb(cfg, tokens: int) -> float:
    """The bytes forward saves for backward (unique storages, parameters excluded) in
    one unsharded process: what every framework must hold at the peak besides the
    weights it gathers."""
    import transformers as tf
    torch.manual_seed(0)
    m = tf.AutoModelForCausalLM.from_config(cfg)
    weights = {p.untyped_storage().data_ptr() for p in m.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    x = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = m(input_ids=x, labels=x).loss
    del loss
    return sum(seen.values()) / 2**20


def build(a, cfg):
    """The model and an optimizer `step()` closure for this framework."""
    import transformers as tf
    fw = a.framework
    torch.manual_seed(0)
    if fw == "deepspeed":
        import deepspeed
        # The bucket sizes Hugging Face's "auto" fills in from the hidden size (what a
        # Trainer user runs); DeepSpeed's own defaults (5e8-element reduce buckets) are
        # sized for large GPUs.
        h = cfg.hidden_size
        ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": h * h,
                                    "stage3_prefetch_bucket_size": int(0.9 * h * h),
                                    "stage3_param_persistence_threshold": 10 * h},
              "steps_per_print": 10**9}
        keep = None
        if a.init == "sharded":
            from transformers.integrations import HfDeepSpeedConfig
            keep = HfDeepSpeedConfig(ds)  # noqa: F841 - from_config builds under zero.Init
        m = tf.AutoModelForCausalLM.from_config(cfg)
        engine, _, _, _ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                               config=ds)
        del keep

        def step(x, phase):
            loss = engine(input_ids=x, labels=x).loss
            phase("forward")
            engine.backward(loss)
            phase("backward")
            engine.step()
            phase("step")
            return loss.item()
        return engine, step, None
    if fw == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        if a.init == "sharded":
            with torch.device("meta"):
                m = tf.AutoModelForCausalLM.from_config(cfg)
        else:
            m = tf.AutoModelForCausalLM.from_config(cfg)
        for block in blocks_of(m):
            fully_shard(block)
        fully_shard(m)
        if a.init == "sharded":
            m.to_empty(device="cpu")
            m.init_weights()
    elif fw == "unsharded":
        m = tf.AutoModelForCausalLM.from_config(cfg)
    else:
        import zeropp
        zeropp.host_memory.release_freed_host_memory()
        if a.init == "sharded":
            with zeropp.deferred_init():
                m = tf.AutoModelForCausalLM.from_config(cfg)
        else:
            m = tf.AutoModelForCausalLM.from_config(cfg)
        cfg_z = zeropp.Config.preset(fw, node_size=a.node_size)
        if a.zeropp_option:  # e.g. async_reduce=0, reduce_buckets=1
            import dataclasses
            k, v = a.zeropp_option.split("=")
            cfg_z = dataclasses.replace(cfg_z, **{k: type(getattr(cfg_z, k))(int(v))})
        zeropp.shard(m, cfg_z)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

    def step(x, phase):
        loss = m(input_ids=x, labels=x).loss
        phase("forward")
        loss.backward()
        phase("backward")
        opt.step()
        opt.zero_grad(set_to_none=True)
        phase("step")
        return loss.item()
    return m, step, opt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--framework", required=True)
    p.add_argument("--init", default="sharded", choices=["sharded", "whole"])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--node-size", type=int, default=2)
    p.add_argument("--activations", action="store_true", help="measure them, no training")
    p.add_argument("--same-batch", action="store_true", help="one batch every step")
    p.add_argument("--zeropp-option", default="", help="one Config field, e.g. async_reduce=0")
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = hf_config(a.model, a.tokens)
    if a.activations:
        print("RESULT " + json.dumps({"activations_mb": activations_mb(cfg, a.tokens),
                                      "params": n_params(cfg),
                                      "unit_mb": largest_unit_mb(cfg)}), flush=True)
        return
    if a.framework != "unsharded":
        dist.init_process_group("gloo")

    rank = dist.get_rank() if dist.is_initialized() else 0
    x0 = torch.ones(1)  # torch's lazy initializations before the baseline
    (x0 * 2).sum()
    base = status_mb("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    model, step, opt = build(a, cfg)
    built_s = time.perf_counter() - t0
    peak_built = status_mb("VmHWM") - base
    g = torch.Generator().manual_seed(1000 + rank)
    losses, t0 = [], time.perf_counter()
    x = torch.randint(0, cfg.vocab_size, (1, a.tokens), generator=g)
    phases: dict[str, float] = {}  # the highest peak each phase of a step reached

    def phase(name: str) -> None:
        phases[name] = max(phases.get(name, 0.0), status_mb("VmHWM") - base)
        reset_peak()

    for _ in range(a.steps):
        reset_peak()
        losses.append(step(x, phase))
        if not a.same_batch:
            x = torch.randint(0, cfg.vocab_size, (1, a.tokens), generator=g)
    s_per_step = (time.perf_counter() - t0) / a.steps
    out = {"rank": rank, "base": base, "peak": max(peak_built, *phases.values()),
           "phases": phases,
           "peak_built": peak_built, "after": status_mb("VmRSS") - base, "losses": losses,
           "built_s": built_s, "s_per_step": s_per_step}
    # What the allocator keeps of freed memory: RSS once glibc hands back every free
    # page it can (the peaks above are already taken).
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    out["after_trim"] = status_mb("VmRSS") - base
    if a.framework not in ("fsdp2", "deepspeed", "unsharded"):
        import zeropp
        out["stats"] = {k: v / 2**20 for k, v in zeropp.memory_stats(model, opt).items()}
    rows = [out]
    if dist.is_initialized():
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, out)
    if rank == 0:
        print("RESULT " + json.dumps({"ranks": rows, "finite": all(
            math.isfinite(v) for r in rows for v in r["losses"])}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)  # no teardown (DeepSpeed's and gloo's can hang or abort at exit)


if __name__ == "__main__":
    main()
