"""torch.compile on a zeropp-sharded model: `torch.compile(model)` after `shard`
gives the eager losses within 1e-4 relative over 12 steps (fp32) and compiles no
frame after the first step; `fullgraph=True` is refused with zeropp's reason (HF
`Trainer(torch_compile=True)` with a DeepSpeed config trains through `engine.compile()`:
tests/deepspeed/test_hf_deepspeed.py). HF GPT-2 at W=2 (zero3; a plain torch LM for the
refusal) and at W=4 as 2x2 (zeropp-plus: every technique's collective beside the compiled
blocks, through AOT autograd with the eager kernels, bit for bit)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from cases import fit, random_batches
from torch import nn

import zeropp
from zeropp.cli.launch import spawn

STEPS = 12


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.fc(self.ln(x))))


class LM(nn.Module):
    """A model as users write one: the blocks called in a loop (dynamo cannot resume
    inside it after a graph break, so this forward runs eagerly and each block's
    forward compiles as its own frame)."""

    def __init__(self, vocab: int = 64, d: int = 32, n: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    class HF(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hf = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32,
                                                 n_layer=2, n_head=2, resid_pdrop=0.0,
                                                 embd_pdrop=0.0, attn_pdrop=0.0))

        def forward(self, x, y):
            return self.hf(input_ids=x, labels=y).loss
    return HF()


def _losses(build, preset: str, compiled: bool, fullgraph: bool = False,
            backend: str = "inductor") -> tuple:
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build()
    zeropp.shard(model, zeropp.Config.preset(preset))
    run = torch.compile(model, fullgraph=fullgraph, backend=backend) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    frames = []
    losses = fit(model, opt, random_batches(STEPS, 64, (2, 16), dist.get_rank()),
                 loss_fn=lambda m, x, y: run(x, y),
                 each=lambda: frames.append((counters["frames"]["total"],
                                             counters["stats"]["unique_graphs"])))
    return losses, frames


def _fullgraph_refusal() -> str:
    try:
        _losses(LM, "zero3", True, fullgraph=True)
    except Exception as e:  # dynamo's Unsupported
        return str(e)
    return ""


def _world2() -> dict:
    torch.set_num_threads(1)
    return {"gpt2": (_losses(_gpt2, "zero3", False), _losses(_gpt2, "zero3", True)),
            "fullgraph": _fullgraph_refusal()}


def _world4() -> tuple:
    torch.set_num_threads(1)
    return (_losses(_gpt2, "zeropp-plus", False),
            _losses(_gpt2, "zeropp-plus", True, backend="aot_eager"))


def _check(eager: tuple, compiled: tuple, tol: float = 1e-4) -> None:
    (a, _), (b, frames) = eager, compiled
    gap = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    assert gap <= tol, (gap, a, b)
    assert frames[0][1] > 0, "nothing compiled"
    assert frames[-1] == frames[0], f"frames compiled after the first step: {frames}"


@pytest.fixture(scope="module")
def world2() -> list:
    pytest.importorskip("transformers")
    return spawn(_world2, 2, timeout=400)


def test_compiled_hf_gpt2_under_zero3_gives_the_eager_losses_and_compiles_once(world2):
    for r in world2:
        _check(*r["gpt2"])


def test_fullgraph_is_refused_with_zeropps_reason(world2):
    assert "zeropp: a unit's gather and free run outside the graph" in world2[0]["fullgraph"]


def test_compiled_zeropp_plus_at_w4_as_2x2_gives_the_eager_losses_bit_for_bit_and_compiles_once():
    """Dynamo and AOT autograd around every technique's hooks, through the "aot_eager"
    backend: the eager kernels, so the losses are the eager ones exactly (inductor's own
    kernels round in their own order, and under qwZ and qgZ a last-bit difference can
    flip a code: 1e-7 at step 5 to 1.1e-4 by 12 measured; inductor under zeropp: W=2)."""
    pytest.importorskip("transformers")
    for eager, compiled in spawn(_world4, 4, 2, timeout=400):
        _check(eager, compiled, tol=0.0)
