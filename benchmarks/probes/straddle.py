"""What a quantization block shared by two parameters costs the smaller one.

A unit's parameters lie end to end in one flat buffer, cut into blocks of up to
`block_size` values with one scale each (the absmax), so a block may hold the tail of one
parameter and the head of the next. A LayerNorm's bias (values ~1e-2) in a block with its
weight (~1) is then rounded on the weight's scale. This probe trains a GPT (2 x 384, with
biases) for a while in one plain process, shards the trained weights at W=4 as 2 x 2, and
compares each parameter as the first forward's gather delivers it with the trained one
(relative L2 error), beside the same codec applied to that parameter alone ("own
blocks": what a layout whose blocks never straddle two parameters would give).

    PYTHONPATH=src python benchmarks/probes/straddle.py [steps]
"""
import sys
import time
from pathlib import Path

import torch

import zeropp
from zeropp.cli.launch import spawn
from zeropp.quant import dequantize, quantize
from zeropp.train.data import get_batch, shakespeare_text
from zeropp.train.model import GPT, GPTConfig

PRESETS = ["qwz", "zeropp", "zeropp-plus"]
CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_embd=384, n_head=6, bias=True)


def trained(steps: int) -> dict:
    torch.manual_seed(0)
    m = GPT(CFG)
    data = torch.tensor(list(shakespeare_text().encode()[:1_000_000]), dtype=torch.long)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = get_batch(data, 8, 64, g)
        loss = m(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"trained {steps} steps: loss {loss.item():.3f}", file=sys.stderr)
    return {k: v.clone() for k, v in m.state_dict().items()}


def gathered(weights: dict, preset: str) -> dict:
    """Every leaf module's weight and bias as this rank's first forward sees them."""
    m = GPT(CFG)
    m.load_state_dict(weights)
    m = zeropp.shard(m, zeropp.Config.preset(preset, node_size=2))
    seen = {}
    for name, mod in m.named_modules():
        if name and not list(mod.children()):
            def look(mod, args, name=name):
                for attr in ("weight", "bias"):
                    t = getattr(mod, attr, None)
                    if isinstance(t, torch.Tensor) and t.numel():
                        seen[f"{name}.{attr}"] = t.detach().clone()
            mod.register_forward_pre_hook(look)
    with torch.no_grad():
        m(torch.zeros(1, 8, dtype=torch.long))
    return seen


def alone(t: torch.Tensor, bits: int = 8, block: int = 2048) -> torch.Tensor:
    flat = t.reshape(-1)
    padded = torch.cat([flat, flat.new_zeros(-flat.numel() % block)])
    return dequantize(quantize(padded, bits=bits, block_size=block))[:flat.numel()].view_as(t)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    t0 = time.perf_counter()
    weights = trained(steps)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from straddle import gathered as fn  # (spawn's workers import it by name)
    runs = {p: spawn(fn, 4, node_size=2, args=(weights, p))[0] for p in PRESETS}
    print(f"# straddle.py {steps} (GPT 2x384 with biases; W=4 as 2x2; INT8 weights, block 2048;"
          f" {time.perf_counter() - t0:.0f} s)\n")
    print("| parameter | numel | absmax | " + " | ".join(PRESETS) + " | own blocks (INT8) |")
    print("|---|---|---|" + "---|" * (len(PRESETS) + 1))
    for name in runs[PRESETS[0]]:
        ref = weights[name]
        cells = [f"{rel(runs[p][name], ref):.4f}" for p in PRESETS]
        print(f"| {name} | {ref.numel():,} | {ref.abs().max().item():.3f} | "
              + " | ".join(cells) + f" | {rel(alone(ref), ref):.4f} |")


if __name__ == "__main__":
    main()
