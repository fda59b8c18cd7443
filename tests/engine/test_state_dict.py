"""`model.state_dict()` / `load_state_dict()` of a sharded model: the
model's own names in its own order, never flat shards; empty placeholders outside
a gather (as DeepSpeed ZeRO-3; the engine's carry its `ds_shape`), the full weights inside; a full state dict loaded
on every rank, or on rank 0 alone under `GatheredParameters(modifier_rank=0)`,
sets every master bit for bit and refreshes hpZ / qWD copies; a wrong key on
rank 0 fails every rank, never a hang. W=2 (ZeRO-3, frozen parameters) and W=4
as 2 nodes x 2 (zeropp-plus), `zeropp.shard` and the DeepSpeed engine."""

from __future__ import annotations

import torch
import torch.distributed as dist
from cases import batch, build, loss_of

import zeropp
from zeropp.cli.launch import spawn
from zeropp.config import named


def _plus_one(sd: dict) -> dict:
    return {k: v + 1 if v.is_floating_point() else v for k, v in sd.items()}


def _equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _loss(model, step: int = 0) -> float:
    x, y = batch("gpt", step, 0, dist.get_world_size(), dist.get_rank())
    with torch.no_grad():
        return loss_of("gpt", model, x, y).item()


def _loss_of_twin(name: str, preset: str, sd: dict) -> float:
    """The loss of a fresh model loaded with `sd` before sharding."""
    twin = build(name)
    twin.load_state_dict(sd)
    return _loss(zeropp.shard(twin, named(preset, 2, collective_timeout=60)))


def _train_step(model, opt, step: int) -> None:
    x, y = batch("gpt", step, 0, dist.get_world_size(), dist.get_rank())
    loss_of("gpt", model, x, y).backward()
    opt.step()
    opt.zero_grad()


def _shard_semantics(name: str, preset: str) -> dict:
    reference = build(name).state_dict()
    model = zeropp.shard(build(name), named(preset, 2, collective_timeout=60))
    out: dict = {}
    sd = model.state_dict()
    out["keys"] = list(sd) == list(reference)
    # (DeepSpeed's `ds_shape` on them is the front door's: the engine's test below)
    out["placeholders"] = all(v.numel() == 0 and not hasattr(v, "ds_shape") for v in sd.values())
    with zeropp.gathered(model):
        inside = model.state_dict()
        attrs = {n: t.detach().clone() for n, t in model.named_parameters()
                 if "_zeropp_flat" not in n}  # none: the originals are attributes now
        lookup = dict(model.named_modules())
        live = {k: getattr(lookup[k.rpartition(".")[0]], k.rpartition(".")[2]).clone()
                for k in inside}
    # Copies: still readable after the context freed the gathered weights.
    out["inside_is_what_forward_uses"] = not attrs and _equal(inside, live)
    out["inside_exact"] = _equal(inside, reference) if preset == "zero3" else None
    if name == "gpt" and preset != "zero3":
        _train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 0)  # copies in play
    # Every rank loads the same full state dict outside a gather.
    loaded = _plus_one(reference)
    model.load_state_dict(loaded)
    out["load_all_ranks"] = _equal(zeropp.full_state_dict(model, all_ranks=True), loaded)
    if name == "gpt":
        out["loss_after_load"] = (_loss(model), _loss_of_twin(name, preset, loaded))
    # Rank 0 alone loads inside GatheredParameters(modifier_rank=0).
    loaded2 = {k: v * 2 if v.is_floating_point() else v for k, v in reference.items()}
    with zeropp.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if dist.get_rank() == 0:
            model.load_state_dict(loaded2)
    out["load_rank0"] = _equal(zeropp.full_state_dict(model, all_ranks=True), loaded2)
    if name == "gpt":
        out["loss_after_rank0_load"] = (_loss(model), _loss_of_twin(name, preset, loaded2))
        # One small parameter, on the ranks whose shards hold it: every rank still
        # refreshes that unit's copies (else routes would differ across ranks).
        partial = {"ln_f.weight": torch.full((32,), 0.5)}
        model.load_state_dict(partial, strict=False)
        out["loss_after_partial_load"] = (_loss(model),
                                          _loss_of_twin(name, preset, {**loaded2, **partial}))
        loaded2.update(partial)
    # A wrong key on rank 0: every rank raises; the others name rank 0 in one line.
    try:
        with zeropp.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            if dist.get_rank() == 0:
                model.load_state_dict({"not.a.key": torch.zeros(1)})
        out["wrong_key"] = None
    except RuntimeError as e:
        out["wrong_key"] = str(e)
    out["unchanged_after_failed_load"] = _equal(zeropp.full_state_dict(model, all_ranks=True),
                                                loaded2)
    # A placeholder (a state dict taken outside a gather) is refused by name.
    try:
        model.load_state_dict(sd)
        out["placeholder"] = None
    except RuntimeError as e:
        out["placeholder"] = str(e)
    return out


def _check(res: list, name: str) -> None:
    for r in res:
        assert r["keys"], "state_dict() keys differ from the unsharded model's (names or order)"
        assert r["placeholders"]
        assert r["inside_is_what_forward_uses"]
        assert r["inside_exact"] in (True, None)
        assert r["load_all_ranks"] and r["load_rank0"]
        assert r["unchanged_after_failed_load"]
        if name == "gpt":
            assert r["loss_after_load"][0] == r["loss_after_load"][1]
            assert r["loss_after_rank0_load"][0] == r["loss_after_rank0_load"][1]
            assert r["loss_after_partial_load"][0] == r["loss_after_partial_load"][1]
        assert "is an empty placeholder" in r["placeholder"]
        assert "zeropp.full_state_dict" in r["placeholder"]
    assert 'Unexpected key(s) in state_dict: "not.a.key"' in res[0]["wrong_key"]
    for r in res[1:]:
        msg = r["wrong_key"]
        assert msg.startswith("zeropp.gathered: rank 0 raised RuntimeError: Error(s) in "
                              "loading state_dict") and "\n" not in msg


def test_state_dict_original_names_and_loads_zeropp_plus_at_2x2():
    _check(spawn(_shard_semantics, 4, 2, args=("gpt", "zeropp-plus"), timeout=240), "gpt")


def test_state_dict_original_names_and_loads_zero3_with_frozen_parameters_at_w2():
    res = spawn(_shard_semantics, 2, 2, args=("mlp", "zero3"), timeout=240)
    _check(res, "mlp")
    assert all(r["inside_exact"] for r in res)


def _engine_semantics() -> dict:
    reference = build("gpt").state_dict()
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                 "zero_hpz_partition_size": 2,
                                 "zero_quantized_gradients": True},
           "zeropp": {"node_size": 2}}
    engine, _, _, _ = zeropp.initialize(model=build("gpt"), config=cfg)
    sd = engine.module.state_dict()
    out = {"keys": list(sd) == list(reference),
           "placeholders": all(v.numel() == 0 and tuple(v.ds_shape) == reference[k].shape
                               for k, v in sd.items())}
    with zeropp.zero.GatheredParameters(engine.module.parameters(), modifier_rank=0):
        if dist.get_rank() == 0:
            engine.module.load_state_dict(_plus_one(reference))
    out["load_rank0"] = _equal(zeropp.full_state_dict(engine.module, all_ranks=True),
                               _plus_one(reference))
    return out


def test_engine_module_state_dict_and_rank0_load_under_gathered_parameters_at_2x2():
    for r in spawn(_engine_semantics, 4, 2, timeout=240):
        assert r == {"keys": True, "placeholders": True, "load_rank0": True}
