"""Guard rails: different models across ranks, a collective that never
completes, and an optimizer built before shard() end in clear errors, never a
hang or a silent no-op."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from cases import build, loss_of

import zeropp
from zeropp.cli.launch import spawn
from zeropp.collectives import CollectiveError
from zeropp.shard import get_state
from zeropp.train.model import GPT, GPTConfig


def _shard_mismatched(change: str) -> tuple[str, float]:
    cfg = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    if dist.get_rank() == 1:
        cfg.update({"width": {"n_embd": 48}, "depth": {"n_layer": 3}}[change])
    t0 = time.monotonic()
    try:
        zeropp.shard(GPT(GPTConfig(**cfg)))
    except ValueError as e:
        return str(e), time.monotonic() - t0
    return "no error", 0.0


@pytest.mark.parametrize("change,first", [
    ("width", "rank 0 has parameter 'wte.weight' shape (64, 32) float32, rank 1 has "
              "parameter 'wte.weight' shape (64, 48) float32"),
    ("depth", "rank 0 has parameter 'wte.weight'"),
])
def test_ranks_with_different_models_all_raise_the_same_error_at_once(change, first):
    res = spawn(_shard_mismatched, 3, 3, args=(change,), timeout=60)
    msgs = {m for m, _ in res}
    assert len(msgs) == 1, msgs  # the same message on every rank
    msg = msgs.pop()
    assert "the model differs across ranks (ranks [1] differ from rank 0)" in msg
    assert first in msg
    assert max(t for _, t in res) < 5.0


def _one_rank_skips_the_forward(timeout: float) -> str:
    model = zeropp.shard(build("gpt"), zeropp.Config(collective_timeout=timeout))
    if dist.get_rank() == 1:
        time.sleep(timeout + 4)  # never joins the gather
        return "skipped"
    x = torch.randint(0, 64, (2, 16))
    t0 = time.monotonic()
    try:
        loss_of("gpt", model, x, x)
    except CollectiveError as e:
        took = time.monotonic() - t0
        # The failed gather is over: its buffer freed, nothing left to finish (a later
        # free() would otherwise wait on it again and raise a second time).
        flats = get_state(model).flats
        for f in flats:
            f.free()
        states = sorted({f.state.name for f in flats})
        return f"{took:.1f}|{','.join(states)}|{e}"
    return "no error"


def test_a_collective_that_never_completes_fails_naming_the_op_and_unit():
    res = spawn(_one_rank_skips_the_forward, 2, 2, args=(2.0,), timeout=60)[0]
    elapsed, states, msg = res.split("|", 2)
    assert 1.5 <= float(elapsed) < 6.0
    assert states == "FREED"
    assert "all_gather/forward of unit <root> did not complete within the 2s " \
           "collective_timeout on rank 0" in msg


def _mismatched_exchanges() -> dict:
    """Rank 0 in GatheredParameters' agreement at exit; rank 1 elsewhere: in a
    checkpoint's agreement, then in an all-gather of its own of the header's size."""
    from zeropp.deepspeed.zero import _EVERY_RANK
    from zeropp.guards import MismatchedCollective, agree, first_failure
    out = {}
    for case in ("agreement", "foreign"):
        t0 = time.monotonic()
        try:
            if dist.get_rank() == 0:
                first_failure(None, "GatheredParameters", _EVERY_RANK)
            elif case == "agreement":
                agree(None, what="checkpoint")
            else:
                dist.all_gather_into_tensor(torch.empty(6, dtype=torch.int64),
                                            torch.tensor([7, 8, 9]))
            out[case] = "no error"
        except MismatchedCollective as e:
            out[case] = f"{time.monotonic() - t0:.1f}|{e}"
    return out


def test_ranks_in_different_exchanges_say_which_rank_is_elsewhere_in_one_line():
    """Before, rank 0 decoded rank 1's bytes as its error message."""
    r0, r1 = spawn(_mismatched_exchanges, 2, timeout=60)
    for case, msg in (("agreement", "rank 1 is not in this GatheredParameters"),
                      ("foreign", "rank 1 is not in this GatheredParameters")):
        took, said = r0[case].split("|", 1)
        assert said.startswith(f"zeropp: {msg} (in another collective meanwhile): "
                               "GatheredParameters is collective, and under ZeRO-3 so is "
                               "transformers' from_pretrained: run it on every rank"), said
        assert "\n" not in said and float(took) < 5
    took, said = r1["agreement"].split("|", 1)  # rank 1 can tell too, in its own words
    assert said == "zeropp: rank 0 is not in this checkpoint (in another collective meanwhile)"
    assert r1["foreign"] == "no error"  # a collective not zeropp's cannot tell


def test_an_optimizer_built_before_shard_is_refused_at_its_first_step():
    model = build("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    zeropp.shard(model)
    x = torch.randint(0, 64, (2, 16))
    loss_of("gpt", model, x, x).backward()
    with pytest.raises(RuntimeError, match=r"holds \d+ parameter\(s\) of the model as it was "
                                           r"before zeropp.shard\(\)"):
        opt.step()
    ok = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ok.step()  # built after shard(): fine


def test_parameters_from_before_shard_added_to_an_optimizer_after_its_first_step_are_refused():
    """The check ran at an optimizer's first step only: a group of pre-shard parameters added
    later (kept from before shard(), say a head to unfreeze) stepped silently, doing nothing."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    head = list(model[1].parameters())
    zeropp.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.add_param_group({"params": head, "lr": 0.01})
    with pytest.raises(RuntimeError, match=r"holds 2 parameter\(s\) of the model as it was"):
        opt.step()
