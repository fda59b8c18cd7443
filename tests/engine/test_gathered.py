"""zeropp.gathered(): generation with the weights gathered once.

A tiny HF GPT-2 at W=4 as 2 nodes x 2: greedy tokens inside the context equal
the unsharded model's (ZeRO-3) and the per-token path's (qwZ + hpZ + qgZ, and
zeropp-plus); no byte moves inside the context however many tokens are
generated; a training step after it gives the loss it gives without it;
exception exit, nesting, writable round trips and misuse errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from cases import task_batch

import zeropp
from zeropp.cli.launch import spawn
from zeropp.config import named

transformers = pytest.importorskip("transformers")

PROMPT = torch.tensor([[5, 9, 13, 2], [40, 41, 42, 43]])


def build():
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=64, n_positions=48, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=63,
                        eos_token_id=63)
    return tf.GPT2LMHeadModel(cfg).eval()


def greedy(model, n: int) -> list[list[int]]:
    out = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[:, PROMPT.shape[1]:].tolist()


def step(model, opt, k: int) -> float:
    x, y = task_batch(k, dist.get_world_size(), dist.get_rank())
    logits = model(input_ids=x).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def sent(model) -> int:
    s = zeropp.comm_stats(model)
    return s["inter_node_bytes"] + s["intra_node_bytes"]


def resident(model) -> list[bool]:
    return [f.gathered for f in model._zeropp_state.flats]


def _generation(preset: str) -> dict:
    cfg = named(preset, 2)
    model = zeropp.shard(build(), cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin = zeropp.shard(build(), cfg)          # the same run without the context
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    out: dict = {}
    if preset != "zero3":  # a step first: hpZ secondaries / qWD copies in play
        out["loss1"] = (step(model, opt, 0), step(twin, twin_opt, 0))
    with torch.no_grad():
        out["per_token"] = greedy(model, 12)
        zeropp.reset_comm_stats(model)
        greedy(model, 4)
        out["per_token_bytes"] = (sent(model), None)
        greedy(model, 12)
        out["per_token_bytes"] = (out["per_token_bytes"][0], sent(model) - out["per_token_bytes"][0])
    zeropp.reset_comm_stats(model)
    with zeropp.gathered(model):
        entry = sent(model)
        with torch.inference_mode():
            out["gathered"] = greedy(model, 12)
        after12 = sent(model)
        with torch.no_grad():
            greedy(model, 30)
        out["bytes"] = (entry, after12 - entry, sent(model) - entry)
        out["resident_inside"] = all(resident(model))
    out["resident_after"] = any(resident(model))
    out["loss2"] = (step(model, opt, 1), step(twin, twin_opt, 1))
    if preset == "zeropp":  # writable under qwZ: the INT8 rounding is not written back
        with torch.no_grad():
            before = zeropp.full_state_dict(model)
            w = model.transformer.h[1].attn.c_attn
            with zeropp.gathered(model):  # INT8 shows some weights as 0 (their masters not)
                out["qwz_shown_zero"] = int((w.weight == 0).sum())
            with zeropp.gathered(model, writable=True):
                out["qwz_writable_shows"] = w.weight.detach().clone()  # the masters
                model.transformer.h[0].mlp.c_proj.bias.fill_(0.25)
                w.weight.zero_()  # those too: compared with INT8's 0, it was no edit
            out["qwz_edit"] = (before, zeropp.full_state_dict(model))
            # Frozen weights stored as INT8: only the edited blocks are requantized.
            frozen = build()
            frozen.transformer.wpe.weight.requires_grad_(False)
            frozen = zeropp.shard(frozen, named("zeropp", 2, quantized_nontrainable_weights=True))
            before = zeropp.full_state_dict(frozen)
            with zeropp.gathered(frozen, writable=True):
                frozen.transformer.wpe.weight[5].fill_(0.125)
            out["int_edit"] = (before, zeropp.full_state_dict(frozen))
    return out


PRESETS = ["zero3", "zeropp", "zeropp-plus"]


def _generations() -> dict:
    return {preset: _generation(preset) for preset in PRESETS}


@pytest.fixture(scope="module")
def generations() -> list:
    return spawn(_generations, 4, 2, timeout=300)  # one world: its ranks import HF once


@pytest.mark.parametrize("preset", PRESETS)
def test_gathered_generates_the_same_tokens_with_no_bytes_per_token(generations, preset):
    res = [r[preset] for r in generations]
    for r in res:
        entry, during12, during30 = r["bytes"]
        assert entry > 0 and during12 == 0 and during30 == 0, r["bytes"]
        # The per-token path moves weights for every token (so the check above can fail).
        four, twelve = r["per_token_bytes"]
        assert twelve > 2 * four > 0, r["per_token_bytes"]
        assert r["gathered"] == r["per_token"]
        assert r["resident_inside"] and not r["resident_after"]
        a, b = r["loss2"]
        assert a == b, r["loss2"]  # bitwise: the context changed nothing for training
    assert all(r["gathered"] == res[0]["gathered"] for r in res)
    if preset == "zero3":  # exact weights: the unsharded model's tokens
        assert res[0]["gathered"] == greedy(build(), 12)
    if preset == "zeropp":
        before, after = res[0]["qwz_edit"]
        name, zeroed = "transformer.h.0.mlp.c_proj.bias", "transformer.h.1.attn.c_attn.weight"
        assert torch.all(after[name] == 0.25)
        # every weight zeroed, those whose INT8 display was 0 already (and master not) too
        assert res[0]["qwz_shown_zero"] > 0 and torch.all(after[zeroed] == 0)
        assert torch.equal(res[0]["qwz_writable_shows"], before[zeroed])
        assert all(torch.equal(before[k], after[k]) for k in before if k not in (name, zeroed))
        before, after = res[0]["int_edit"]
        name = "transformer.wpe.weight"
        assert all(torch.equal(before[k], after[k]) for k in before if k != name)
        b, a = before[name].reshape(-1), after[name].reshape(-1)
        assert torch.allclose(a[160:192], torch.full((32,), 0.125), atol=1e-3)
        assert torch.allclose(a[:384], b[:384].where(
            (torch.arange(384) < 160) | (torch.arange(384) >= 192), a[:384]), atol=1e-3)
        assert torch.equal(a[384:], b[384:])  # other ranks' shards: bytes untouched


def _semantics() -> dict:
    rank = dist.get_rank()
    out: dict = {}
    model = zeropp.shard(build(), named("zero3", 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    st = model._zeropp_state
    h1 = model.transformer.h[1]

    # Exception exit frees everything; training afterwards works.
    try:
        with zeropp.gathered(model):
            raise KeyError("boom")
    except KeyError:
        pass
    out["exc"] = (any(resident(model)), st.gathered_depth, [u.pins for u in st.units])
    out["loss_after_exc"] = step(model, opt, 0)

    # Nesting: the inner context adds nothing and frees nothing the outer holds.
    with zeropp.gathered(model, units=["transformer.h.1"]):
        held = resident(model)
        with zeropp.gathered(model):
            zeropp.reset_comm_stats(model)
            with zeropp.gathered(model, units=[h1]):
                with torch.no_grad():
                    greedy(model, 3)
            out["nested_inner_bytes"] = sent(model)
            out["nested_all"] = all(resident(model))
        out["nested_after_inner"] = (held, resident(model))
        zeropp.reset_comm_stats(model)
        with torch.no_grad():
            greedy(model, 3)
        out["nested_bytes"] = sent(model)  # the units the outer context does not hold
    out["nested_after_outer"] = any(resident(model))

    # Writable round trip (every rank the same edit): the next training forward sees it.
    with torch.no_grad():
        before = zeropp.full_state_dict(model)
    with zeropp.gathered(model, writable=True):
        with torch.no_grad():
            h1.mlp.c_fc.bias.fill_(0.5)
            h1.mlp.c_fc.bias[0] = -2.0
    with torch.no_grad():
        after = zeropp.full_state_dict(model)
    out["edit"] = (before, after) if rank == 0 else None
    seen = {}
    hook = h1.mlp.c_fc.register_forward_hook(
        lambda m, a, o: seen.setdefault("bias", m.bias.detach().clone()))
    out["loss_after_edit"] = step(model, opt, 1)
    hook.remove()
    out["seen"] = seen["bias"]

    # modifier_rank: only rank 0's edit counts; every rank sees it.
    with zeropp.gathered(model, writable=True, modifier_rank=0):
        with torch.no_grad():
            h1.attn.c_proj.bias.fill_(float(rank + 1))
    with zeropp.gathered(model):
        out["modifier"] = h1.attn.c_proj.bias.detach().clone()
        # Inside an outer context too: its resident weights are rank 0's edit on every rank.
        with zeropp.gathered(model, writable=True, modifier_rank=0):
            with torch.no_grad():
                h1.attn.c_attn.bias.fill_(float(rank + 1))
        out["modifier_nested"] = h1.attn.c_attn.bias.detach().clone()

    # Exception inside writable: the edit is discarded.
    with zeropp.gathered(model):
        kept = h1.ln_1.weight.detach().clone()
    try:
        with zeropp.gathered(model, writable=True):
            with torch.no_grad():
                h1.ln_1.weight.fill_(9.0)
            raise ValueError("abandon")
    except ValueError:
        pass
    with zeropp.gathered(model):
        out["discarded"] = torch.equal(h1.ln_1.weight, kept)

    # max_bytes: keep what fits, in model order; the rest gathers per token.
    sizes = [sum(f.padded_numel * 4 for f in u.flats) for u in st.units]
    with zeropp.gathered(model, max_bytes=sizes[0] + sizes[1]):
        out["budget"] = [u.pins for u in st.units]

    # Misuse: each a clear error, and the model still trains afterwards.
    errors = {}

    def catch(key, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            errors[key] = f"{type(e).__name__}: {e}"

    def enter(m, **kw):
        with zeropp.gathered(m, **kw):
            pass
    catch("unsharded", lambda: enter(build()))
    catch("unit", lambda: enter(model, units=["transformer.h.7"]))
    catch("modifier", lambda: enter(model, modifier_rank=0))
    catch("budget", lambda: enter(model, max_bytes=-1))

    def backward_inside():
        with zeropp.gathered(model):
            x, y = task_batch(2, 4, rank)
            model(input_ids=x).logits.sum().backward()
    catch("backward", backward_inside)

    def step_inside():
        with zeropp.gathered(model):
            opt.step()
    catch("step", step_inside)

    def during_backward():
        x, _ = task_batch(3, 4, rank)
        logits = model(input_ids=x).logits
        logits.register_hook(lambda g: enter(model))
        logits.sum().backward()
    catch("in_backward", during_backward)
    opt.zero_grad()
    out["errors"] = errors
    out["state_after_errors"] = (st.gathered_depth, [u.pins for u in st.units])
    # A gradient an aborted backward left behind (half a unit's flat gradient,
    # one parameter's own) is dropped by the next iteration: injected on every
    # flat, then two clean backwards agree.
    for f in st.flats:
        if f.trainable:
            f.grads.grad, f.grads.arrived = torch.ones(f.padded_numel), {0}
            f.params[-1].grad = torch.ones(f.params[-1].shape)
    grads = []
    for _ in range(2):
        x, y = task_batch(4, 4, rank)
        logits = model(input_ids=x).logits
        F.cross_entropy(logits.reshape(-1, 64), y.reshape(-1)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.zero_grad()
    out["grads_agree"] = all(torch.equal(a, b) for a, b in zip(*grads))
    # A backward that raised after units' reductions went to the reduce threads: none lands in
    # .grad after the loop's zero_grad() (their accumulation raced it); the next is a clean one.
    def raise_in_backward(m, a, o):
        (o[0] if isinstance(o, tuple) else o).register_hook(
            lambda g: (_ for _ in ()).throw(KeyError("mid-backward")))
    hook = model.transformer.h[0].register_forward_hook(raise_in_backward)
    for _ in range(2):  # (the first raises)
        x, y = task_batch(4, 4, rank)
        try:
            F.cross_entropy(model(input_ids=x).logits.reshape(-1, 64), y.reshape(-1)).backward()
        except KeyError:
            hook.remove()
            opt.zero_grad()
    out["after_aborted_backward"] = all(torch.equal(p.grad, g)
                                        for p, g in zip(model.parameters(), grads[0]))
    opt.zero_grad()

    # A failure while entering (say, no memory for the snapshot) pins nothing:
    # the next step's weights reach the next forward.
    victim = st.flats[1]

    def fail() -> None:
        raise MemoryError("simulated: no memory for the snapshot")
    victim.install_attributes = fail
    try:
        with zeropp.gathered(model, writable=True):
            pass
    except MemoryError:
        pass
    del victim.install_attributes
    out["entry_failure"] = ([u.pins for u in st.units], st.gathered_depth, any(resident(model)))
    step(model, opt, 5)
    x, _ = task_batch(6, 4, rank)
    with torch.no_grad():
        fresh = model(input_ids=x).logits
        with zeropp.gathered(model):
            inside = model(input_ids=x).logits
    out["after_entry_failure"] = torch.equal(fresh, inside)

    # A forward that failed midway left units gathered; after the step they hold
    # old weights: gathered() must drop them, as a training forward does.
    xb, yb = task_batch(7, 4, rank)
    logits = model(input_ids=xb).logits
    F.cross_entropy(logits.reshape(-1, 64), yb.reshape(-1)).backward()
    hook = h1.register_forward_hook(lambda m, a, o: (_ for _ in ()).throw(KeyError("midway")))
    try:
        model(input_ids=xb)
    except KeyError:
        pass
    hook.remove()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        with zeropp.gathered(model):
            inside = model(input_ids=x).logits
        fresh = model(input_ids=x).logits
    out["after_aborted_forward"] = torch.equal(fresh, inside)
    return out


def _rank_local_exception() -> dict:
    """One rank leaves a writable context by an exception: no rank writes back,
    every other rank raises the failing rank's error at the exit (instead of going
    on alone into its next collective), and the next forward takes the same route
    everywhere (hpZ: no hang)."""
    rank = dist.get_rank()
    model = zeropp.shard(build(), named("zeropp", 2, collective_timeout=60))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt, 0)  # hpZ secondaries in play
    with torch.no_grad():
        before = zeropp.full_state_dict(model)
    raised = None
    try:
        with zeropp.gathered(model, writable=True):
            with torch.no_grad():
                model.transformer.h[0].mlp.c_fc.bias.fill_(3.0)
            if rank == 1:
                raise ValueError("a rank-local failure (say, in a reward function)")
    except (ValueError, RuntimeError) as e:
        raised = f"{type(e).__name__}: {e}"
    with torch.no_grad():
        after = zeropp.full_state_dict(model)
    loss = step(model, opt, 1)  # would hang if the ranks' gather routes differed
    # Nested writable contexts (qwZ): the outer writes back what changed since the inner's
    # exit, not the unedited weights of the blocks the inner's edit touched (their INT8).
    with torch.no_grad():
        stepped = zeropp.full_state_dict(model)
    with zeropp.gathered(model, writable=True, modifier_rank=0):
        with zeropp.gathered(model, writable=True, modifier_rank=0):
            with torch.no_grad():
                model.transformer.h[1].mlp.c_fc.bias[0] = 0.5
    with torch.no_grad():
        nested = zeropp.full_state_dict(model)
    return {"raised": raised, "loss": loss,
            "unchanged": all(torch.equal(before[k], after[k]) for k in before) if rank == 0
            else None,
            "nested": {k: (v != nested[k]).nonzero().flatten().tolist()
                       for k, v in stepped.items() if not torch.equal(v, nested[k])}}


def test_gathered_rank_local_exception_discards_every_ranks_edit_without_hanging():
    res = spawn(_rank_local_exception, 4, 2, timeout=240)
    assert res[1]["raised"] == "ValueError: a rank-local failure (say, in a reward function)"
    for r in (0, 2, 3):
        assert res[r]["raised"] == (
            "RuntimeError: zeropp.gathered: rank 1 raised ValueError: a rank-local failure "
            "(say, in a reward function) inside the context; every rank's edits were discarded")
    assert res[0]["unchanged"]
    assert res[0]["nested"] == {"transformer.h.1.mlp.c_fc.bias": [0]}
    assert all(math.isfinite(r["loss"]) for r in res)


def test_gathered_exception_nesting_writable_and_misuse():
    res = spawn(_semantics, 4, 2, timeout=240)
    for r in res:
        assert r["exc"] == (False, 0, [0, 0, 0])
        assert r["nested_inner_bytes"] == 0 and r["nested_all"] and r["nested_bytes"] > 0
        held, inside = r["nested_after_inner"]
        assert held == inside and any(held) and not all(held)  # h.1 still resident
        assert not r["nested_after_outer"]
        # The edit reached every rank's next training forward, exactly (ZeRO-3).
        want = torch.full((128,), 0.5)
        want[0] = -2.0
        assert torch.equal(r["seen"], want)
        assert torch.equal(r["modifier"], torch.ones(32))  # rank 0's value everywhere
        assert torch.equal(r["modifier_nested"], torch.ones(96))
        assert r["discarded"]
        assert r["budget"] == [1, 1, 0]
        e = r["errors"]
        assert "not sharded with zeropp.shard()" in e["unsharded"]
        assert "'transformer.h.7' is not a unit" in e["unit"] and "transformer.h.1" in e["unit"]
        assert "modifier_rank needs writable=True" in e["modifier"]
        assert "max_bytes=-1" in e["budget"]
        assert "backward inside zeropp.gathered()" in e["backward"]
        assert "optimizer.step() inside zeropp.gathered()" in e["step"]
        assert "while a backward is in flight" in e["in_backward"]
        assert r["state_after_errors"] == (0, [0, 0, 0])
        assert r["grads_agree"] and r["after_aborted_backward"]
        assert r["entry_failure"] == ([0, 0, 0], 0, False) and r["after_entry_failure"]
        assert r["after_aborted_forward"]
    before, after = res[0]["edit"]
    name = "transformer.h.1.mlp.c_fc.bias"
    assert after[name][0] == -2.0 and torch.all(after[name][1:] == 0.5)
    for k in before:  # every other weight: exactly the master before the edit
        if k != name:
            assert torch.equal(before[k], after[k]), k


def test_rollout_example_reward_rises_with_one_gather_per_rollout(tmp_path):
    """examples/rollout.py at toy size (4 ranks as 2x2, zeropp): generation
    under gathered() alternating with policy-gradient updates; the mean reward
    of the last 3 iterations is far above the first 3 (chance is 1/32)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "examples" / "rollout.py"
    out = tmp_path / "log.jsonl"
    subprocess.run([sys.executable, str(script), "--iters", "15", "--out", str(out)],
                   check=True, timeout=300, capture_output=True)
    log = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(log) == 15
    first = sum(r["mean_reward"] for r in log[:3]) / 3
    last = sum(r["mean_reward"] for r in log[-3:]) / 3
    assert last > 0.3 and last > 5 * first, (first, last)
    # Every rollout moved the same bytes: one gather, whatever the token count.
    assert len({r["generate_bytes"] for r in log}) == 1 and log[0]["generate_bytes"] > 0
