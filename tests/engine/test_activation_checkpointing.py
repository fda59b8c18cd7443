"""Activation checkpointing on a sharded model, with every preset: HF's
`gradient_checkpointing_enable()` (the layer's forward runs again inside
backward, through zeropp's hooks) gives the same losses, bit for bit, as the
run without it, at 2x2, and moves the same bytes: the recomputation runs on the
weights the unit's backward gather brought, so it costs no extra collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from cases import fit, random_batches

import zeropp
from zeropp.cli.launch import spawn

pytest.importorskip("transformers")


def _losses(preset: str, recompute: bool) -> tuple[list[float], int]:
    import transformers as tf
    torch.manual_seed(0)
    m = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=3,
                                         n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0))
    if recompute:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    zeropp.shard(m, zeropp.Config.preset(preset, node_size=2))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    out = fit(m, opt, random_batches(3, 64, (2, 16), dist.get_rank()),
              loss_fn=lambda m, x, y: m(input_ids=x, labels=y).loss)
    st = zeropp.comm_stats(m)
    return out, st["inter_node_bytes"] + st["intra_node_bytes"]


PRESETS = ["zero3", "zeropp", "zeropp-plus"]


def _both() -> dict:
    out = {}
    for preset in PRESETS:
        plain, plain_bytes = _losses(preset, False)
        ckpt, ckpt_bytes = _losses(preset, True)
        out[preset] = {"plain": plain, "ckpt": ckpt, "plain_bytes": plain_bytes,
                       "ckpt_bytes": ckpt_bytes}
    return out


@pytest.fixture(scope="module")
def runs() -> list:
    return spawn(_both, 4, node_size=2, timeout=300)  # one world: its ranks import HF once


@pytest.mark.parametrize("preset", PRESETS)
def test_gradient_checkpointing_gives_the_same_losses_bit_for_bit(runs, preset):
    for r in (r[preset] for r in runs):
        assert r["ckpt"] == r["plain"], r
        assert r["ckpt_bytes"] == r["plain_bytes"] > 0, r
