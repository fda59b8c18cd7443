"""Shared by the step benchmarks (paired_step, profile_step, cpu_attribution): the GPT
workload they time, built the same way on every rank of a W=4 world as 2 x 2."""

from __future__ import annotations

import torch

import zeropp
from zeropp.train.model import GPT, GPTConfig


class HFGPT2(torch.nn.Module):
    """Hugging Face's GPT-2 124M (its default config, built offline) behind the
    (idx, targets) -> (logits, loss) call the steps make."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        self.hf = GPT2LMHeadModel(GPT2Config())

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        # use_cache=False: training needs no KV cache, and under torch.compile with a
        # graph break per block the cache's per-layer state recompiles each block
        out = self.hf(input_ids=x, labels=y, use_cache=False)
        return out.logits, out.loss


def sharded_gpt(preset: str, layers: int = 6, width: int = 384, hf: bool = False):
    """gpt-LAYERSxWIDTH (fp32, byte vocabulary, 64-token context) from seed 0 (or, with
    `hf`, HF GPT-2 124M), sharded with `preset` at node size 2, and its AdamW."""
    torch.manual_seed(0)
    model = HFGPT2() if hf else GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=layers,
                                              n_embd=width, n_head=width // 64))
    zeropp.shard(model, zeropp.Config.preset(preset, node_size=2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(g: torch.Generator) -> torch.Tensor:
    """A micro-batch of 2 x 64 random bytes (inputs and targets alike)."""
    return torch.randint(0, 256, (2, 64), generator=g)


def train_step(model, opt, x: torch.Tensor) -> None:
    """One step on `x`, gradients clipped as `zeropp train` clips them."""
    model(x, x)[1].backward()
    zeropp.clip_grad_norm_(model, 1.0)
    opt.step()
    opt.zero_grad()
