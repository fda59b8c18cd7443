"""Peak host memory of Hugging Face's `from_pretrained` under ZeRO-3, and through
`deepspeed.initialize`, per rank: zeropp's alias against the real DeepSpeed, the same
script (`HfDeepSpeedConfig` alive, `AutoModelForCausalLM.from_pretrained(path)`, then
`deepspeed.initialize(model=model, config=cfg)` and one forward), torchrun, gloo.

    python benchmarks/hf_zero3_load_memory.py --model gpt2-355m --world 4 \
        --deepspeed-python /work/dsvenv/bin/python

The checkpoint is a randomly initialized model of the named configuration saved with
`save_pretrained` (safetensors; `--shard` sets max_shard_size) in --ckpt, made once.
DeepSpeed runs with DS_ACCELERATOR=cpu and `"torch_adam": true` (its fused CPU Adam
would be compiled first). Memory: each rank's peak RSS (getrusage) before
`from_pretrained` (after imports, init_process_group and a tiny copy of the model
built and run, so that the modeling code is in), after it, and after
`initialize`; "load" is the peak's growth during `from_pretrained`, against the
rank's share of the model's bytes and the largest checkpoint file.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = {  # name: (transformers config class, its arguments)
    "gpt2-124m": ("GPT2Config", dict(n_embd=768, n_layer=12, n_head=12)),
    "gpt2-355m": ("GPT2Config", dict(n_embd=1024, n_layer=24, n_head=16)),
    "llama-1b": ("LlamaConfig", dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                     num_hidden_layers=22, num_attention_heads=32,
                                     num_key_value_heads=4, tie_word_embeddings=False)),
}


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _now_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(path: str, zeropp: bool) -> None:
    if zeropp:
        import zeropp as zp
        zp.install_as_deepspeed()
    import deepspeed
    import torch
    import torch.distributed as dist
    import transformers
    from transformers.integrations import HfDeepSpeedConfig
    dist.init_process_group("gloo")
    w = dist.get_world_size()
    cfg = {"train_batch_size": 2 * w, "train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    # the modeling code imported and run once on a tiny copy, so that "before" holds it
    tiny = transformers.AutoConfig.from_pretrained(path)
    for k in ("n_layer", "n_head", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads"):
        if hasattr(tiny, k):
            setattr(tiny, k, 1)
    for k in ("n_embd", "hidden_size", "intermediate_size", "vocab_size"):
        if hasattr(tiny, k):
            setattr(tiny, k, 8)
    transformers.AutoModelForCausalLM.from_config(tiny)(input_ids=torch.zeros(1, 2).long())
    keep = HfDeepSpeedConfig(cfg)  # noqa: F841 (transformers holds it weakly)
    before = _peak_mb()
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    loaded, held = _peak_mb(), _now_mb()
    params = list(model.parameters())
    partitioned = sum(hasattr(p, "ds_id") and p.numel() == 0 for p in params)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    initialized = _peak_mb()
    x = torch.arange(16).reshape(2, 8) % 50
    loss = engine(input_ids=x, labels=x).loss.item()
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "before": before, "loaded": loaded,
                                  "initialized": initialized, "loss": loss, "held": held,
                                  "partitioned": partitioned, "params": len(params)}),
          flush=True)
    dist.barrier()


def make_checkpoint(name: str, ckpt: Path, shard: str) -> Path:
    import torch
    import transformers
    path = ckpt / f"{name}-{shard}"
    if not (path / "config.json").is_file():
        cls, kw = CONFIGS[name]
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kw))
        model.save_pretrained(path, max_shard_size=shard)
        del model
    return path


def run(python: str, path: Path, world: int, zeropp: bool) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if not zeropp:
        env["DS_ACCELERATOR"] = "cpu"
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
           "--master-port", str(29600 + world), __file__, "--worker", str(path)]
    if zeropp:
        cmd.append("--zeropp")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    rows = [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or len(rows) != world:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-355m", choices=sorted(CONFIGS))
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--shard", default="50GB", help="save_pretrained's max_shard_size")
    ap.add_argument("--ckpt", default=os.path.join(tempfile.gettempdir(), "zero3_load_ckpt"))
    ap.add_argument("--deepspeed-python", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--zeropp", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, a.zeropp)
    path = make_checkpoint(a.model, Path(a.ckpt), a.shard)
    files = sorted(path.glob("*.safetensors"))
    largest = max(f.stat().st_size for f in files) / 2**20
    total = sum(f.stat().st_size for f in files) / 2**20
    share = total / a.world
    print(f"{a.model}: {total:.0f} MB in {len(files)} file(s), largest {largest:.0f} MB; "
          f"W={a.world}, a rank's share {share:.0f} MB; bound share + largest file + 15% = "
          f"{1.15 * (share + largest):.0f} MB")
    print("| run | rank | peak RSS before load MB | after from_pretrained | RSS then | "
          "after initialize | load growth MB | growth / bound | partitioned | first loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    runs = [("zeropp", sys.executable, True)]
    if a.deepspeed_python:
        runs.append(("DeepSpeed", a.deepspeed_python, False))
    for label, python, zp in runs:
        for r in run(python, path, a.world, zp):
            growth = r["loaded"] - r["before"]
            print(f"| {label} | {r['rank']} | {r['before']:.0f} | {r['loaded']:.0f} | "
                  f"{r['held']:.0f} | {r['initialized']:.0f} | {growth:.0f} | "
                  f"{growth / (1.15 * (share + largest)):.2f} | "
                  f"{r['partitioned']}/{r['params']} | {r['loss']:.6f} |", flush=True)


if __name__ == "__main__":
    main()
