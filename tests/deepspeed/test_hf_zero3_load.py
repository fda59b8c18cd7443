"""Hugging Face's `from_pretrained` under ZeRO-3 on the alias (`HfDeepSpeedConfig` alive,
so transformers builds the model inside `deepspeed.zero.Init` and loads each module
inside `GatheredParameters(modifier_rank=0)`), W=4 as 2 x 2, gloo: afterwards every
parameter has DeepSpeed's look (ds_id, ds_shape, ds_numel, 0 elements) and holds only
its partition (ds_tensor: 1/4 of it), equal to the checkpoint's values; the first loss
after `deepspeed.initialize` is the plain load's. A GPT-2 with tied embeddings from a
checkpoint in several safetensors files, and a composite vision encoder + GPT-2
decoder (DeepSpeed's nesting test's model)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from zeropp.cli.launch import spawn

# not imported here: the spawned ranks import this file, and the alias must come first
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed")

DS = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
      "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
X = torch.arange(16).reshape(2, 8) % 50


def _save(tmp_path):
    import transformers as tf
    torch.manual_seed(0)
    gpt = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                           n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                           attn_pdrop=0.0))
    gpt.save_pretrained(tmp_path / "gpt2", max_shard_size="40KB")  # several files
    vit = tf.ViTConfig(image_size=8, patch_size=4, num_hidden_layers=1, hidden_size=8,
                       num_attention_heads=2, intermediate_size=16)
    dec = tf.GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=1, n_head=2,
                        add_cross_attention=True, is_decoder=True)
    tf.VisionEncoderDecoderModel(tf.VisionEncoderDecoderConfig.from_encoder_decoder_configs(
        vit, dec)).save_pretrained(tmp_path / "vision")
    plain = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    with torch.no_grad():
        return plain(input_ids=X, labels=X).loss.item()


def _checkpoint(path) -> dict:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _load(root: str) -> dict:
    from pathlib import Path

    import zeropp
    zeropp.install_as_deepspeed()
    import deepspeed
    import transformers as tf
    from transformers.integrations import HfDeepSpeedConfig
    torch.set_num_threads(1)
    keep = HfDeepSpeedConfig(DS)  # noqa: F841 (transformers holds it weakly)
    out = {}
    for name, cls in (("gpt2", tf.GPT2LMHeadModel), ("vision", tf.VisionEncoderDecoderModel)):
        model = cls.from_pretrained(Path(root) / name)
        params = list(model.named_parameters())
        ckpt = _checkpoint(Path(root) / name)
        look = all(hasattr(p, "ds_id") and hasattr(p, "ds_tensor") and p.numel() == 0
                   and p.ds_numel == torch.Size(p.ds_shape).numel() for _, p in params)
        parts = max(p.ds_tensor.numel() * 4 - p.ds_numel for _, p in params) if look else None
        same = []
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            for n, p in params:
                same.append(n not in ckpt or torch.equal(p.detach(), ckpt[n]))
        out[name] = {"look": look, "padding": parts, "values": all(same),
                     "empty_after": all(p.numel() == 0 for _, p in params),
                     "lazy": getattr(tf.modeling_utils.load_state_dict, "_zeropp", False)}
        if name == "gpt2":
            engine, *_ = deepspeed.initialize(model=model, config=DS)
            out[name]["loss"] = engine(input_ids=X, labels=X).loss.item()
        else:
            out[name]["edits"] = _edits(model, deepspeed)
    return out


def _edits(model, deepspeed) -> list:
    """Rank 0's edits inside GatheredParameters(modifier_rank=0) over two parameters of
    one shape, listed in a different order on odd ranks (transformers passes a set),
    with a nested GatheredParameters inside: each keeps its own edit, on every rank."""
    import torch.distributed as dist
    named = dict(model.named_parameters())
    a, b = named["decoder.transformer.h.0.ln_1.weight"], named["decoder.transformer.h.0.ln_2.weight"]
    order = [a, b] if dist.get_rank() % 2 == 0 else [b, a]
    with deepspeed.zero.GatheredParameters(order, modifier_rank=0):
        with deepspeed.zero.GatheredParameters([a]):  # an enclosing one holds it: no-op
            pass
        if dist.get_rank() == 0:
            with torch.no_grad():
                a.fill_(1.0)
                b.fill_(2.0)
    with deepspeed.zero.GatheredParameters([a, b]):
        return [a.detach().unique().tolist(), b.detach().unique().tolist(), tuple(a.shape)]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero3_load")
    plain = _save(root)
    return plain, spawn(_load, 4, 2, args=(str(root),), timeout=240)


@pytest.mark.parametrize("name", ["gpt2", "vision"])
def test_every_parameter_has_deepspeeds_partitioned_look_after_from_pretrained(loaded, name):
    for r in loaded[1]:
        assert r[name]["look"] and r[name]["empty_after"], r[name]
        assert 0 <= r[name]["padding"] < 4, r[name]  # ds_tensor: a quarter, rounded up


@pytest.mark.parametrize("name", ["gpt2", "vision"])
def test_the_gathered_partitions_equal_the_checkpoint_bit_for_bit(loaded, name):
    assert all(r[name]["values"] for r in loaded[1])


def test_first_loss_after_initialize_equals_the_plain_loads(loaded):
    plain, runs = loaded
    for r in runs:
        assert abs(r["gpt2"]["loss"] - plain) <= 1e-6 * abs(plain), (r["gpt2"]["loss"], plain)


def test_rank_0_reads_the_checkpoint_lazily_and_transformers_loader_is_the_one_known(loaded):
    """hf_loader.py's note: transformers' modeling_utils.load_state_dict was replaced by
    the lazy reader (the values are checked above); a transformers whose function has
    another signature fails here, and its own loader stays."""
    import transformers.modeling_utils as mu

    from zeropp.deepspeed.hf_loader import signature_known
    assert all(r["gpt2"]["lazy"] for r in loaded[1])
    assert signature_known(mu.load_state_dict)


def test_a_lazy_checkpoint_tensor_reads_its_file_at_each_use(tmp_path):
    from safetensors.torch import save_file

    from zeropp.deepspeed.hf_loader import _lazy_state_dict
    a, b = torch.randn(3, 4), torch.arange(6, dtype=torch.int64)
    save_file({"a": a, "b": b}, tmp_path / "m.safetensors")
    from transformers.modeling_utils import str_to_torch_dtype
    lazy = _lazy_state_dict(str(tmp_path / "m.safetensors"), str_to_torch_dtype)
    assert lazy["a"].shape == (3, 4) and lazy["b"].dtype == torch.int64
    p = torch.nn.Parameter(torch.zeros(3, 4))
    with torch.no_grad():
        p.copy_(lazy["a"])  # what torch's _load_from_state_dict does
    assert torch.equal(p.detach(), a) and torch.equal(torch.cat([lazy["b"], lazy["b"]]),
                                                      torch.cat([b, b]))


def test_rank_0s_edits_land_whatever_order_each_rank_lists_them_and_nesting_is_harmless(loaded):
    for r in loaded[1]:
        assert r["vision"]["edits"] == [[1.0], [2.0], (8,)], r["vision"]["edits"]
