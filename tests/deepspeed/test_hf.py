"""Hugging Face transformers models (GPT-2 with tied embeddings, Llama), built
offline from tiny configs: automatic units, parity with single-process
training, ZeRO++ training, and export that `from_pretrained` loads."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from cases import fit, task_batch

import zeropp
from zeropp.cli.launch import spawn

transformers = pytest.importorskip("transformers")

LAYER = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer"}


def build(kind: str):
    import transformers as tf
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.GPT2LMHeadModel(cfg)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=16)
    return tf.LlamaForCausalLM(cfg)


def _loss(model, x, y):
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _train(model, steps: int, world: int, rank, lr: float) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return fit(model, opt, (task_batch(s, world, rank) for s in range(steps)), loss_fn=_loss)


def _sharded(kind: str, kw: dict, steps: int, lr: float, ckpt: str | None):
    model = zeropp.shard(build(kind), zeropp.Config(**kw))
    units = [type(u.module).__name__ for u in model._zeropp_state.units]
    losses = _train(model, steps, dist.get_world_size(), dist.get_rank(), lr)
    if kind == "llama":  # an embedding's backward reads no weights: no backward gather
        by_unit = zeropp.comm_stats(model)["by_unit"]
        emb, root = by_unit["model.embed_tokens"], by_unit["<root>"]
        assert emb.get("all_gather/backward", 0) == 0 and emb["all_gather/forward"] == steps
        assert root["all_gather/backward"] == root["all_gather/forward"] == steps
    logits = None
    if ckpt:
        zeropp.save_checkpoint(ckpt, model)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=task_batch(99, 1, None)[0]).logits
    return losses, units, logits


KINDS = ["gpt2", "llama"]


def _each_kind(kw: dict, steps: int, lr: float, ckpt: str | None) -> dict:
    return {kind: _sharded(kind, kw, steps, lr, ckpt and f"{ckpt}/{kind}") for kind in KINDS}


@pytest.fixture(scope="module")
def exact(tmp_path_factory) -> tuple:
    """Both kinds in one world (its ranks import HF once): 10 steps, saved."""
    ckpt = tmp_path_factory.mktemp("ck")
    return ckpt, spawn(_each_kind, 2, 2, args=({}, 10, 1e-3, str(ckpt)), timeout=300)


@pytest.mark.parametrize("kind", KINDS)
def test_hf_model_matches_single_process_and_exports_for_from_pretrained(tmp_path, exact, kind):
    ref = _train(build(kind), 10, 2, None, 1e-3)
    ckpt, res = exact[0] / kind, [r[kind] for r in exact[1]]
    units = res[0][1]
    # decoder layers + root; Llama's untied input embedding is a unit of its own (not
    # gathered for backward: checked in _sharded); the head stays in the root
    assert units.count(LAYER[kind]) == 2 and len(units) == {"gpt2": 3, "llama": 4}[kind]
    mean = [sum(r[0][s] for r in res) / 2 for s in range(10)]
    for a, b in zip(mean, ref):
        assert abs(a - b) <= 1e-5 * abs(b), (mean, ref)
    from zeropp.cli.main import main
    assert main(["export", str(ckpt), str(tmp_path / "hf")]) == 0
    loaded = type(build(kind)).from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        logits = loaded(input_ids=task_batch(99, 1, None)[0]).logits
    assert torch.allclose(logits, res[0][2], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def zeropp_on() -> list:
    kw = dict(quantized_weights=True, hpz_partition_size=2, quantized_gradients=True,
              block_size=64)
    return spawn(_each_kind, 4, 2, args=(kw, 30, 3e-3, None), timeout=300)


@pytest.mark.parametrize("kind", KINDS)
def test_hf_model_trains_with_zeropp_on(zeropp_on, kind):
    res = [r[kind] for r in zeropp_on]
    mean = [sum(r[0][s] for r in res) / 4 for s in range(30)]
    first, last = sum(mean[:3]) / 3, sum(mean[-3:]) / 3
    assert last < 0.8 * first, mean
