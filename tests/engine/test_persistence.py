"""Persistent parameters (Config.persistence_threshold, DeepSpeed's
`stage3_param_persistence_threshold`): a unit's small parameters stay gathered
between steps, re-gathered once after each optimizer step instead of in every
forward and backward.

One spawned world per layout runs every case; the tests check its results.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from cases import batch, build, fit, loss_of
from torch import nn

import zeropp
from zeropp.cli.launch import spawn

STEPS = 5
THRESHOLD = 64  # the MLP's biases (24, 24, 5) persist, its weights (288, 576, 120) do not


def _train(model: nn.Module, opt: torch.optim.Optimizer, world: int, rank: int) -> list[float]:
    return fit(model, opt, (batch("mlp", s, 0, world, rank) for s in range(STEPS)),
               loss_fn=lambda m, x, y: loss_of("mlp", m, x, y))


def _shown(model: nn.Module) -> dict[str, torch.Tensor]:
    """The module attributes as they are now (outside any gather)."""
    return {f"{n}.{a}": getattr(m, a).detach().clone() for n, m in model.named_modules()
            if isinstance(m, nn.Linear) for a in ("weight", "bias")}


def _case(preset: str, threshold: int, node_size: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("mlp")
    cfg = zeropp.Config.preset(preset, node_size=node_size, persistence_threshold=threshold)
    zeropp.shard(model, cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = _train(model, opt, world, rank)
    out = {"losses": losses, "stats": zeropp.comm_stats(model),
           "persistent": sorted(f.name for f in model._zeropp_state.flats if f.persistent),
           "shown": _shown(model), "full": zeropp.full_state_dict(model, all_ranks=True)}
    # load_state_dict outside a gather (every rank): the resident weights show the
    # loaded values at once.
    model.load_state_dict({k: v + 1 for k, v in out["full"].items()})
    out["after_load"] = model.layers[0].bias.detach().clone()
    # A rank-0 edit under gathered(modifier_rank=0) (DeepSpeed's GatheredParameters)
    # reaches every rank's resident weights on exit.
    with zeropp.gathered(model, writable=True, modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                model.layers[0].bias.fill_(0.25)
    out["after_edit"] = model.layers[0].bias.detach().clone()
    return out


CASES = [("zero3", 0), ("zero3", THRESHOLD), ("zeropp-plus", 0), ("zeropp-plus", THRESHOLD)]


def _engine_case() -> dict:
    """Under the DeepSpeed engine: DeepSpeed's default threshold (1e5) keeps every
    parameter of the MLP gathered; empty_partition_cache() lets them go."""
    rank, world = dist.get_rank(), dist.get_world_size()
    eng, _, _, _ = zeropp.initialize(model=build("mlp"), config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    out = {}
    for s in range(2):
        x, y = batch("mlp", s, 0, world, rank)
        eng.backward(loss_of("mlp", eng, x, y))
        eng.step()
    out["numel_after_step"] = sum(p.numel() for p in eng.module.parameters())
    eng.empty_partition_cache()
    out["numel_after_empty"] = sum(p.numel() for p in eng.module.parameters())
    x, y = batch("mlp", 2, 0, world, rank)
    eng.backward(loss_of("mlp", eng, x, y))
    eng.step()
    out["numel_after_next_step"] = sum(p.numel() for p in eng.module.parameters())
    return out


def _late_group(late: bool) -> list[float]:
    """Fused Adam (it bumps no version counter: only the step hooks regather the
    persistent flats), zeropp-plus, the model's parameters in it from the start or added
    by `add_param_group` after a first step over another parameter."""
    torch.manual_seed(0)
    model = zeropp.shard(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                                       nn.Linear(64, 1)),
                         zeropp.Config.preset("zeropp-plus", node_size=2))
    other = nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([other] if late else [other, *model.parameters()], lr=1e-2, fused=True)
    opt.step()
    if late:
        opt.add_param_group({"params": list(model.parameters())})
    losses = []
    for step in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * dist.get_rank() + step))
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _run(node_size: int) -> list:
    late = [_late_group(False), _late_group(True)] if dist.get_world_size() == 4 else None
    return [_case(p, t, node_size) for p, t in CASES] + [_engine_case(), late]


@pytest.fixture(scope="module")
def w2():
    return spawn(_run, 2, 2, args=(2,), timeout=240)


@pytest.fixture(scope="module")
def w4():
    return spawn(_run, 4, 2, args=(2,), timeout=300)


def _mean_losses(world: list, case: int) -> list[float]:
    return [sum(r[case]["losses"][s] for r in world) / len(world) for s in range(STEPS)]


def test_only_parameters_at_or_under_the_threshold_persist(w2):
    # every Linear of the MLP is a unit; its bias is small: layers.0's trainable bias,
    # layers.1's and layers.2's frozen ones (flats of their own)
    assert w2[0][0]["persistent"] == [] and w2[0][2]["persistent"] == []
    assert w2[0][1]["persistent"] == ["layers.0._zeropp_flat1", "layers.1._zeropp_flat1",
                                      "layers.2._zeropp_flat1"]


def test_persistence_changes_zero3_losses_by_under_1e6_relative(w2, w4):
    # Not bit for bit: the flat buffers change, and with them where an element
    # falls in gloo's chunked sums (the last bits of a gradient).
    for world in (w2, w4):
        for a, b in zip(_mean_losses(world, 1), _mean_losses(world, 0)):
            assert abs(a - b) <= 1e-6 * abs(b)


def test_zeropp_plus_with_persistence_within_1pct_of_without(w4):
    for a, b in zip(_mean_losses(w4, 3), _mean_losses(w4, 2)):
        assert abs(a - b) <= 0.01 * abs(b)


@pytest.mark.parametrize("case", [1, 3])
def test_persistent_weights_are_readable_between_steps_and_the_same_on_every_rank(w2, w4, case):
    for world in (w2, w4):
        for r in world:
            shown, full = r[case]["shown"], r[case]["full"]
            for i in range(3):
                got = shown[f"layers.{i}.bias"]
                assert got.shape == full[f"layers.{i}.bias"].shape
                assert torch.equal(got, world[0][case]["shown"][f"layers.{i}.bias"])
                if case == 1:  # zero3: exactly the master weights
                    assert torch.equal(got, full[f"layers.{i}.bias"])
            # weights above the threshold: 0 elements outside a gather, as before
            assert shown["layers.0.weight"].numel() == 0


def test_persistent_flats_skip_the_backward_gather_and_are_gathered_once_per_step(w2):
    plain, kept = w2[0][0]["stats"]["by_op"], w2[0][1]["stats"]["by_op"]
    # the one trainable persistent flat: after each step (the frozen ones only once,
    # in the first forward)
    assert kept["all_gather/persistent"]["calls"] == STEPS
    assert "all_gather/persistent" not in plain
    assert (kept["all_gather/backward"]["payload_bytes"]
            < plain["all_gather/backward"]["payload_bytes"])
    total = lambda ops: sum(v["payload_bytes"] for k, v in ops.items()  # noqa: E731
                            if k.startswith("all_gather"))
    assert total(kept) < total(plain)


@pytest.mark.parametrize("case", [1, 3])
def test_load_state_dict_and_a_rank0_edit_reach_the_resident_weights_on_every_rank(
        w2, w4, case):
    for world in (w2, w4):
        for r in world:
            want = r[case]["full"]["layers.0.bias"] + 1
            tol = 0 if case == 1 else 0.02  # zeropp-plus: qwZ's INT8 of the masters
            assert torch.allclose(r[case]["after_load"], want, rtol=0, atol=tol)
            assert torch.allclose(r[case]["after_edit"], torch.full((24,), 0.25), rtol=0,
                                  atol=tol)
            assert torch.equal(r[case]["after_edit"], world[0][case]["after_edit"])


def test_model_persistence_threshold_caps_the_total_in_model_order():
    # biases of 24, 24 and 5 elements under a cap of 30: the first (24) and the last (5);
    # the second would make 48. World size 1, no process group.
    from cases import FrozenMLP
    model = zeropp.shard(FrozenMLP(), zeropp.Config(persistence_threshold=THRESHOLD,
                                                   model_persistence_threshold=30))
    kept = {n for f in model._zeropp_state.flats if f.persistent
            for i in f.infos for n in i.fqns}
    assert kept == {"layers.0.bias", "layers.2.bias"}


def test_engine_default_keeps_small_parameters_gathered_until_empty_partition_cache(w2):
    numel = sum(p.numel() for p in build("mlp").parameters())  # 1037: each at most 1e5
    for r in w2:
        e = r[-2]
        assert (e["numel_after_step"], e["numel_after_empty"], e["numel_after_next_step"]) == (
            numel, 0, numel)


def test_parameters_added_to_an_optimizer_after_its_first_step_are_hooked(w4):
    """The same losses bit for bit either way at W=4 as 2x2 (before: the optimizer was
    never hooked, and its steps never reached the persistent flats' gathered weights)."""
    for r in w4:
        start, late = r[-1]
        assert start == late and len(set(start)) == 4, (start, late)
