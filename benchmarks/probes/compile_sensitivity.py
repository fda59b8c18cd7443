"""How far apart two eager runs drift when only their last bits differ, next to how far
torch.compile's run drifts from eager: tests/engine/test_compile.py's tiny HF GPT-2 (2 layers,
n_embd 32, AdamW lr 1e-2, 12 steps, fp32) at W=4 as 2x2, under zero3 and zeropp-plus.
Against the eager run (SDPA attention) of the same seed:
- `ulp`: eager, one weight of the token embedding one ulp higher before `shard`;
- `attn-eager`: eager with HF's eager attention instead of SDPA (same math, another
  rounding order, as a compiled kernel has);
- `compiled`: `torch.compile(model)` after `shard`, SDPA.
Each row: the largest relative loss gap by step 5, 10 and 12, over the ranks, per seed.
Under qwZ / qgZ a last-bit difference can move a value across a rounding boundary,
which changes a code by one step; such flips compound over the steps.

    python benchmarks/probes/compile_sensitivity.py [--seeds 0,1,2] [--steps 12]
"""
import argparse
import math

import torch
import torch.distributed as dist
from torch import nn

import zeropp
from zeropp.cli.launch import spawn

VARIANTS = ("eager", "ulp", "attn-eager", "compiled")


def _gpt2(attn: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    class HF(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            cfg._attn_implementation = attn
            self.hf = GPT2LMHeadModel(cfg)

        def forward(self, x, y):
            return self.hf(input_ids=x, labels=y).loss
    return HF()


def _losses(preset: str, variant: str, seed: int, steps: int) -> list:
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = _gpt2("eager" if variant == "attn-eager" else "sdpa")
    if variant == "ulp":
        with torch.no_grad():
            w = model.hf.transformer.wte.weight
            w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(math.inf))
    zeropp.shard(model, zeropp.Config.preset(preset))
    run = torch.compile(model) if variant == "compiled" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1000 * seed + dist.get_rank())
    out = []
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 16), generator=gen)
        loss = run(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _world(presets: list, seeds: list, steps: int) -> dict:
    torch.set_num_threads(1)
    return {(p, v, s): _losses(p, v, s, steps) for p in presets for s in seeds for v in VARIANTS}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--presets", default="zero3,zeropp-plus")
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    presets = a.presets.split(",")
    ranks = spawn(_world, 4, 2, args=(presets, seeds, a.steps), timeout=1800)
    marks = [m for m in (5, 10, a.steps) if m <= a.steps]
    print(f"W=4 as 2x2, tiny HF GPT-2, {a.steps} steps; max relative gap to eager (SDPA), "
          "over ranks, by step " + " / ".join(map(str, marks)) + "\n")
    print("| preset | variant | " + " | ".join(f"seed {s}" for s in seeds) + " |")
    print("|---|---|" + "---|" * len(seeds))
    for p in presets:
        for v in VARIANTS[1:]:
            cells = []
            for s in seeds:
                gaps = []
                for m in marks:
                    g = max(abs(x - y) / abs(x) for r in ranks
                            for x, y in zip(r[(p, "eager", s)][:m], r[(p, v, s)][:m]))
                    gaps.append(f"{g:.1e}")
                cells.append(" / ".join(gaps))
            print(f"| {p} | {v} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
