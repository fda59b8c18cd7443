"""DeepSpeed's public ZeRO-3 API as its own unit tests use it: the
tensor-fragment API, `zero_to_fp32` over zeropp checkpoints, the leaf-module
flags, `init_distributed(init_method, rank, world_size)`, checkpoint tag
validation, the user-driven backward (`engine.scale`, `needs_scaler`,
`managed_gradient_accumulation`), a second `initialize` of one model, param
groups that leave trainable parameters out, and the one-line refusals (MiCS).
Worlds of 2 ranks; the model is cases.py's FrozenMLP (frozen layers included)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from cases import batch, build, loss_of
from torch import nn

import zeropp
from zeropp.cli.launch import spawn
from zeropp.deepspeed import utils as ds_utils
from zeropp.deepspeed import zero_to_fp32
from zeropp.deepspeed.parameters import master_shards
from zeropp.units import unit_modules


def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3}, **extra}


def _step(engine, k: int) -> torch.Tensor:
    x, y = batch("mlp", k, 0, dist.get_world_size(), dist.get_rank())
    loss = loss_of("mlp", engine, x, y)
    engine.backward(loss)
    return loss


# ---- the tensor-fragment API ----------------------------------------------------------
def _fragments() -> dict:
    engine, _, _, _ = zeropp.initialize(model=build("mlp"), config=_config())
    mlp = engine.module
    out: dict = {}
    full = zeropp.full_state_dict(mlp, all_ranks=True)
    # Under the engine, named_parameters() is the model's own, as DeepSpeed's: its names
    # in its order, 0 elements outside a gather (ds_shape the shape), full inside.
    named = list(mlp.named_parameters())
    out["names"] = [n for n, _ in named] == [n for n, _ in build("mlp").named_parameters()]
    out["engine_names"] = [n for n, _ in engine.named_parameters()] == [
        f"module.{n}" for n, _ in named]
    out["empty_outside"] = all(p.numel() == 0 and tuple(p.ds_shape) == full[n].shape
                               for n, p in named)
    with zeropp.zero.GatheredParameters([p for _, p in named]):
        out["full_inside"] = all(torch.equal(p, full[n]) for n, p in named)
    w = mlp.layers[0].weight
    out["get_param"] = torch.equal(ds_utils.safe_get_full_fp32_param(w), full["layers.0.weight"])
    out["frozen_is_none"] = (ds_utils.safe_get_full_fp32_param(mlp.layers[1].weight) is None
                             and ds_utils.safe_get_full_grad(mlp.layers[1].weight) is None)
    out["no_grad_before_backward"] = ds_utils.safe_get_full_grad(w) is None
    _step(engine, 0)
    # The full gradient of the master shard is every rank's local gradient, in rank order.
    shard = engine.optimizer.param_groups[0]["params"][0]
    g = ds_utils.safe_get_full_grad(shard)
    pieces = [torch.empty_like(shard.grad) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, shard.grad)
    out["grad_is_ranks_pieces"] = torch.equal(g, torch.cat(pieces)[:g.numel()])
    out["ds_shape"] = tuple(shard.ds_shape) == tuple(g.shape) and shard.ds_numel == g.numel()
    value = torch.arange(w.ds_numel, dtype=torch.float32).view(w.ds_shape) / 7  # w: 0 elements
    ds_utils.safe_set_full_grad(w, value)
    out["set_grad"] = torch.equal(ds_utils.safe_get_full_grad(w), value)
    ds_utils.safe_update_full_grad_vectorized([w], lambda old, p: old * 0 + 5)
    out["update_grad"] = ds_utils.safe_get_full_grad(w).eq(5).all().item()
    engine.step()
    ds_utils.safe_set_full_fp32_param(w, value)
    out["set_param"] = torch.equal(ds_utils.safe_get_full_fp32_param(w), value)
    with zeropp.zero.GatheredParameters(w):
        out["forward_sees_set_param"] = torch.equal(mlp.layers[0].weight, value)
    avg = ds_utils.safe_get_full_optimizer_state(w, "exp_avg")
    ds_utils.safe_set_full_optimizer_state(w, value * 3, "exp_avg")
    out["optimizer_state"] = (avg is not None and avg.shape == w.ds_shape and torch.equal(
        ds_utils.safe_get_full_optimizer_state(w, "exp_avg"), value * 3))
    local = ds_utils.safe_get_local_fp32_param(shard)
    ds_utils.safe_set_local_fp32_param(shard, local + 1)
    out["local"] = torch.equal(ds_utils.safe_get_local_fp32_param(shard), local + 1)
    return out


def test_named_parameters_are_the_models_own_and_tensor_fragment_api_reads_and_writes_at_w2():
    for r in spawn(_fragments, 2, timeout=180):
        assert r == {k: True for k in r}, r


# ---- zero_to_fp32, tag validation, a second initialize ---------------------------------
def _checkpoints(tmp: str) -> dict:
    rank = dist.get_rank()
    engine, _, _, _ = zeropp.initialize(model=build("gpt"), config=_config(
        checkpoint={"tag_validation": "Fail"}))
    out: dict = {}
    _step_gpt(engine)
    engine.step()
    engine.save_checkpoint(tmp)
    full = zeropp.full_state_dict(engine.module, all_ranks=True)
    sd = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(tmp)
    out["zero_to_fp32_bitwise"] = sorted(sd) == sorted(full) and all(
        torch.equal(sd[k], full[k]) for k in full)
    out["tied_once"] = sd["lm_head.weight"] is sd["wte.weight"]
    if rank == 0:
        zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(tmp, f"{tmp}/fp32")
    dist.barrier()
    plain = build("gpt")
    plain.load_state_dict(torch.load(f"{tmp}/fp32/pytorch_model.bin"))
    out["converted_loads"] = all(torch.equal(plain.state_dict()[k], full[k]) for k in full)
    try:
        engine.save_checkpoint(tmp, tag=f"tag-{rank}")
        out["fail_tag"] = None
    except AssertionError as e:
        out["fail_tag"] = str(e)
    # A second initialize of the same (sharded) model: a new engine over its shards.
    again, _, _, _ = zeropp.initialize(model=engine.module, config=_config())
    out["again_keeps_weights"] = all(
        torch.equal(v, full[k]) for k, v in zeropp.full_state_dict(again.module,
                                                                   all_ranks=True).items())
    _step_gpt(again)
    again.step()
    out["again_steps"] = again.global_steps == 1
    try:
        zeropp.initialize(model=engine.module, config=_config(
            zero_optimization={"stage": 3, "zero_quantized_weights": True}))
        out["other_settings"] = None
    except zeropp.DeepSpeedConfigError as e:
        out["other_settings"] = str(e)
    warn_engine, _, _, _ = zeropp.initialize(model=build("gpt"), config=_config())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_engine.save_checkpoint(tmp, tag=f"w-{rank}")
    out["warn_tag"] = (os.path.isdir(f"{tmp}/w-0") and not os.path.exists(f"{tmp}/w-1")
                       and any("different tags" in str(w.message) for w in caught))
    return out


def _step_gpt(engine) -> None:
    x, y = batch("gpt", 0, 0, dist.get_world_size(), dist.get_rank())
    engine.backward(loss_of("gpt", engine, x, y))


def test_zero_to_fp32_tag_validation_and_a_second_initialize_at_w2(tmp_path):
    res = spawn(_checkpoints, 2, args=(str(tmp_path),), timeout=240)
    for r in res:
        assert r["zero_to_fp32_bitwise"] and r["tied_once"] and r["converted_loads"]
        assert "different tags" in r["fail_tag"] and "tag_validation is Fail" in r["fail_tag"]
        assert r["again_keeps_weights"] and r["again_steps"]
        assert "already sharded with other ZeRO settings" in r["other_settings"]
        assert "quantized_weights: False -> True" in r["other_settings"]
        assert r["warn_tag"]


# ---- the user-driven backward, accumulation the caller manages, param groups -----------
def _user_backward() -> dict:
    out: dict = {}
    cfg = _config(gradient_accumulation_steps=2)
    a, _, _, _ = zeropp.initialize(model=build("mlp"), config=cfg)
    b, _, _, _ = zeropp.initialize(model=build("mlp"), config=cfg)
    x, y = batch("mlp", 0, 0, dist.get_world_size(), dist.get_rank())
    a.backward(loss_of("mlp", a, x, y))
    b.scale(loss_of("mlp", b, x, y)).backward()
    out["scale_equals_backward"] = all(
        torch.equal(p.grad, q.grad) for p, q in zip(master_shards(a.module),
                                                    master_shards(b.module))
        if p.requires_grad)
    out["needs_scaler_fp32"] = a.optimizer.needs_scaler() is False
    # DeepSpeed's PyTorch-style backward: loss.backward() on what the engine returned gives
    # engine.backward's gradients (divided by GAS=2 once), also when the model returns its
    # loss beside the output it was computed from (a hook on that output would divide twice).
    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = build("mlp")

        def forward(self, x, y):
            out = self.net(x)
            return {"loss": F.mse_loss(out.float(), y), "out": out}
    for name, make, loss in [("direct", lambda: build("mlp"), lambda e: loss_of("mlp", e, x, y)),
                             ("direct_both", Both, lambda e: e(x, y)["loss"])]:
        c, _, _, _ = zeropp.initialize(model=make(), config=cfg)
        d, _, _, _ = zeropp.initialize(model=make(), config=cfg)
        c.backward(loss(c))
        loss(d).backward()
        out[name] = all(torch.equal(p.grad, q.grad) for p, q in zip(
            master_shards(c.module), master_shards(d.module)) if p.requires_grad)
    try:
        a.scale(torch.ones(3, requires_grad=True))
        out["non_scalar"] = None
    except AssertionError as e:
        out["non_scalar"] = str(e)
    un, _, _, _ = zeropp.initialize(model=build("mlp"), config=_config(
        gradient_accumulation_steps=4, managed_gradient_accumulation=False))
    applied = []
    for k in range(3):
        _step(un, k)
        un.step()
        applied.append(un.was_step_applied())
    out["unmanaged_every_step"] = (applied == [True, True, True] and un.global_steps == 3
                                   and un.managed_gradient_accumulation() is False)
    # global_samples: the micro-batches since the last step, each micro 2 x W=2 rows
    samples = [un.global_samples]
    for k in range(3):
        _step(un, 3 + k)
    un.step()
    samples.append(un.global_samples)
    out["unmanaged_samples_count_micro_batches"] = samples == [12, 24]
    # A boundary only while step() runs, as DeepSpeed answers
    seen = []
    un.optimizer.register_step_pre_hook(lambda *a: seen.append(un.is_gradient_accumulation_boundary()))
    _step(un, 9)
    out["unmanaged_boundary_in_step_only"] = not un.is_gradient_accumulation_boundary()
    un.step()
    out["unmanaged_boundary_in_step_only"] &= seen == [True]
    try:  # the caller owns the boundary: setting it is refused, as DeepSpeed does
        un.set_gradient_accumulation_boundary(True)
        out["unmanaged_boundary_refused"] = False
    except AssertionError as e:
        out["unmanaged_boundary_refused"] = "set_gradient_accumulation_boundary" in str(e)
    # Param groups that leave a trainable parameter out: it is simply not stepped.
    model = build("mlp")
    groups = [{"params": [model.layers[0].weight, model.layers[0].bias]}]
    part, _, _, _ = zeropp.initialize(model=model, model_parameters=groups, config=_config())
    before = zeropp.full_state_dict(part.module, all_ranks=True)
    _step(part, 0)
    part.step()
    after = zeropp.full_state_dict(part.module, all_ranks=True)
    out["left_out_not_stepped"] = (torch.equal(before["layers.2.weight"], after["layers.2.weight"])
                                   and not torch.equal(before["layers.0.weight"],
                                                       after["layers.0.weight"]))
    return out


def test_user_backward_unmanaged_accumulation_and_partial_param_groups_at_w2():
    for r in spawn(_user_backward, 2, timeout=180):
        assert "scalar tensor" in r.pop("non_scalar")
        assert r == {k: True for k in r}, r


def _fp16_direct_backward() -> str:
    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = build("mlp")

        def forward(self, x, y):
            return torch.nn.functional.mse_loss(self.net(x), y)

    engine, _, _, _ = zeropp.initialize(model=Wrapped(), config=_config(
        fp16={"enabled": True, "initial_scale_power": 8}))
    x, y = batch("mlp", 0, 0, dist.get_world_size(), dist.get_rank())
    out = {}
    for name, run in [("scalar", lambda: engine(x, y).backward()),  # refused
                      ("tuple", lambda: (engine(x, y),)[0].backward()),  # refused
                      ("two_forwards", lambda: engine.backward(engine(x, y) + engine(x, y))),
                      ("two_scaled", lambda: engine.scale(engine(x, y) + engine(x, y)).backward()),
                      ("after_scaled", lambda: engine(x, y).backward())]:  # refused again
        try:
            run()
            out[name] = "no error"
        except RuntimeError as e:
            out[name] = str(e)
    return out


def test_fp16_loss_backward_without_scale_is_refused_at_w2():
    """A direct backward of an fp16 engine's output, a scalar or inside a tuple, is refused;
    backward() or scale() over two forwards' outputs is not (nor refused after)."""
    for r in spawn(_fp16_direct_backward, 2, timeout=180):
        assert {k: "Loss scaling is required" in v for k, v in r.items()} == {
            "scalar": True, "tuple": True, "two_forwards": False, "two_scaled": False,
            "after_scaled": True}, r


# ---- launch, accelerator, refusals ----------------------------------------------------
def _init_file(tmp: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(k, None)
    zeropp.init_distributed("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item()}


def test_init_distributed_honours_init_method_rank_and_world_size(tmp_path):
    res = spawn(_init_file, 2, args=(str(tmp_path),), timeout=120)
    assert res == [{"rank": 0, "world": 2, "sum": 3.0}, {"rank": 1, "world": 2, "sum": 3.0}]


def test_cpu_accelerator_device_count_reads_deepspeeds_local_size(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert zeropp.get_accelerator().device_count() == (
        torch.cuda.device_count() if torch.cuda.is_available() else 4)


def test_mics_is_refused_in_one_line():
    from zeropp.deepspeed import config as ds_config
    with pytest.raises(ValueError, match="mics_shard_size=2 is not supported"):
        ds_config.parse(_config(zero_optimization={"stage": 3, "mics_shard_size": 2}), 2)
    with pytest.raises(NotImplementedError, match="MiCS_Init"):
        zeropp.zero.MiCS_Init()
    with pytest.raises(ValueError, match="checkpoint.tag_validation='foo' is invalid"):
        ds_config.parse(_config(checkpoint={"tag_validation": "foo"}), 2)


def test_zero_init_initializes_torch_distributed_as_deepspeeds_does():
    code = ("import torch.distributed as dist, zeropp\n"
            "with zeropp.zero.Init():\n    pass\n"
            "print(dist.is_initialized(), dist.get_world_size())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["MASTER_PORT"] = "0"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.stdout.split() == ["True", "1"], r.stderr[-2000:]


# ---- leaf modules ----------------------------------------------------------------------
class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])


class _MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Experts(), _Experts()])


def test_leaf_flags_by_class_name_and_suffix_and_a_leaf_is_one_unit():
    model = _MoE()
    assert len(unit_modules(model, None)) == 1 + 2 + 6  # root, blocks, experts
    found = ds_utils.set_z3_leaf_modules(model, [f"{__name__}._Experts"])
    assert found == [model.blocks[0], model.blocks[1]]
    assert ds_utils.get_z3_leaf_modules(model) == found and ds_utils.z3_leaf_module(found[0])
    # Each leaf is one unit; its experts are not units of their own.
    assert list(unit_modules(model, None).values()) == ["", "blocks.0", "blocks.1"]
    ds_utils.unset_z3_leaf_modules(model, [_Experts])
    assert ds_utils.get_z3_leaf_modules(model) == []
    # A leaf container (never called, so it cannot gather) gives its modules to the unit
    # around it; a leaf root makes the whole model one unit.
    ds_utils.set_z3_leaf_modules_by_name(model, ["blocks"])
    assert list(unit_modules(model, None).values()) == [""]
    ds_utils.set_z3_leaf_modules_by_name(model, ["blocks.0.experts", ""])
    assert list(unit_modules(model, None).values()) == [""]
    ds_utils.unset_z3_leaf_modules(model, [nn.ModuleList, _MoE])
    mods, missing = ds_utils.set_z3_leaf_modules_by_name(model, ["blocks.1", "nope"],
                                                         raise_if_not_found=False)
    assert mods == [model.blocks[1]] and missing == ["nope"]
    mods, missing = ds_utils.set_z3_leaf_modules_by_suffix(model, ["experts.2"])
    assert len(mods) == 2 and missing == []
    with pytest.raises(ValueError, match="No modules named"):
        ds_utils.set_z3_leaf_modules_by_name(model, ["nope"])


# ---- initialize inside an open zero.Init() --------------------------------------------
def _initialize_inside_init() -> dict:
    whole = build("gpt").state_dict()
    with zeropp.zero.Init():
        engine, _, _, _ = zeropp.initialize(model=build("gpt"), config=_config())
        before = zeropp.full_state_dict(engine.module, all_ranks=True)
        _step_gpt(engine)  # the engine trains inside the context too
        engine.step()
    after = zeropp.full_state_dict(engine.module, all_ranks=True)
    return {"built_as_whole": all(torch.equal(before[k], whole[k]) for k in whole),
            "stepped": not torch.equal(after["h.0.mlp.fc.weight"], whole["h.0.mlp.fc.weight"])}


def test_initialize_inside_an_open_zero_init_materializes_the_build_so_far_at_w2():
    for r in spawn(_initialize_inside_init, 2, timeout=180):
        assert r == {"built_as_whole": True, "stepped": True}


def _tagged_under_init() -> tuple:
    import threading

    from zeropp.deferred import is_deferred, materialize
    other: dict = {}

    def build() -> None:
        other["plain"] = nn.Linear(4, 3)
        with zeropp.zero.Init():
            other["own"] = nn.Linear(4, 3)
    with zeropp.zero.Init(), zeropp.zero.Init():  # nested, as DeepSpeed's tests build
        layer = nn.Linear(4, 3)
        lazy = nn.LazyLinear(3)  # (before: its registration raised ValueError)
        t = threading.Thread(target=build)
        t.start()
        t.join()
    w, plain, own = layer.weight, other["plain"].weight, other["own"].weight
    return (type(w.ds_id).__name__, w.ds_status.name, tuple(w.ds_shape), w.ds_numel,
            tuple(materialize(w).shape),  # still the deferred build, values on demand
            nn.parameter.is_lazy(lazy.weight) and not hasattr(lazy.weight, "ds_id"),
            plain.numel(), hasattr(plain, "ds_id"), is_deferred(own), own.numel())


def test_parameters_built_under_zero_init_carry_deepspeeds_zero3_attributes():
    """A lazy one (LazyLinear's: no shape until its first forward) is left as it is. What
    another thread builds meanwhile is its own: a plain Linear keeps its 12 elements and no
    ds_id, one under that thread's Init is deferred and shows 0 elements (before: the plain
    one was tagged and showed 0 elements, its forward failed; the other Init's was built
    whole)."""
    # In a worker (a process group exists): Init would start one in the test process.
    assert spawn(_tagged_under_init, 1, timeout=120) == [
        ("int", "NOT_AVAILABLE", (3, 4), 12, (3, 4), True, 12, False, True, 0)]


def _gather_before_initialize() -> dict:
    torch.manual_seed(3)
    whole = nn.Linear(4, 2).weight.detach().clone()
    torch.manual_seed(3)
    with zeropp.zero.Init():
        layer = nn.Linear(4, 2)
    with zeropp.zero.GatheredParameters(layer.weight, modifier_rank=1):
        inside = (layer.weight.ds_status.name, torch.equal(layer.weight, whole))
        if dist.get_rank() == 1:
            with torch.no_grad():
                layer.weight.zero_()
    return {"inside": inside, "after_edit": layer.weight.eq(0).all().item()}


def test_gathered_parameters_before_initialize_has_the_build_and_modifier_edits_reach_all():
    for r in spawn(_gather_before_initialize, 2, timeout=120):
        assert r == {"inside": ("AVAILABLE", True), "after_edit": True}


def test_leaf_module_config_key_flags_modules_by_class_name_and_suffix():
    from zeropp.deepspeed import config as ds_config
    from zeropp.deepspeed.compat import _mark_leaf_modules
    ds = ds_config.parse(_config(zero_optimization={"stage": 3, "leaf_module": {
        "classes": f"{__name__}._Experts", "name_suffixes": ["experts.1"]}}), 2)
    model = _MoE()
    _mark_leaf_modules(model, ds.leaf_module)
    assert ds_utils.get_z3_leaf_modules(model) == [model.blocks[0], model.blocks[0].experts[1],
                                                   model.blocks[1], model.blocks[1].experts[1]]
    with pytest.raises(ValueError, match="leaf_module.classes=3 is invalid"):
        ds_config.parse(_config(zero_optimization={"stage": 3, "leaf_module": {"classes": 3}}), 2)


def _allreduce_gradients() -> dict:
    engine, _, _, _ = zeropp.initialize(model=build("mlp"), config=_config())
    _step(engine, 0)
    grads = [p.grad.clone() for p in master_shards(engine.module) if p.grad is not None]
    engine.allreduce_gradients()  # a no-op after backward: reduced already
    after = [p.grad for p in master_shards(engine.module) if p.grad is not None]
    return {"same": len(grads) > 0 and all(torch.equal(a, b) for a, b in zip(grads, after)),
            "sparse": engine.sparse_tensor_module_names == set()}


def test_allreduce_gradients_after_backward_changes_nothing_at_w2():
    for r in spawn(_allreduce_gradients, 2, timeout=120):
        assert r == {"same": True, "sparse": True}


class MixtralSparseMoeBlock(nn.Module):
    """Named as transformers' Mixtral MoE block (DeepSpeed's default leaf class)."""


MixtralSparseMoeBlock.__module__ = "transformers.models.mixtral.modeling_mixtral"


def test_leaf_module_defaults_are_deepspeeds_three_hf_moe_blocks_unless_classes_given():
    from zeropp.deepspeed import config as ds_config
    from zeropp.deepspeed.compat import _mark_leaf_modules
    ds = ds_config.parse(_config(), 2)
    assert ds.leaf_module == {"classes": ds_config.DEFAULT_LEAF_MODULE_CLASSES,
                              "names": [], "name_suffixes": []}
    assert len(ds_config.DEFAULT_LEAF_MODULE_CLASSES) == 3
    model = nn.Sequential(nn.Linear(2, 2), MixtralSparseMoeBlock())
    _mark_leaf_modules(model, ds.leaf_module)
    assert ds_utils.get_z3_leaf_modules(model) == [model[1]]
    # "names" alone keeps the default classes; "classes" replaces them (as DeepSpeed's).
    ds = ds_config.parse(_config(zero_optimization={"stage": 3, "leaf_module": {
        "names": "0"}}), 2)
    assert ds.leaf_module["classes"] == ds_config.DEFAULT_LEAF_MODULE_CLASSES
    ds = ds_config.parse(_config(zero_optimization={"stage": 3, "leaf_module": {
        "classes": []}}), 2)
    assert ds.leaf_module["classes"] == []


def test_torch_autocast_and_weight_quantization_are_refused_memory_efficient_linear_accepted():
    from zeropp.deepspeed import config as ds_config
    with pytest.raises(ValueError, match="torch_autocast is not supported"):
        ds_config.parse(_config(torch_autocast={"enabled": True, "dtype": "torch.bfloat16"}), 2)
    with pytest.raises(ValueError, match="weight_quantization is not supported"):
        ds_config.parse(_config(weight_quantization={"quantized_initialization": {}}), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "unknown key" warning
        ds_config.parse(_config(zero_optimization={"stage": 3,
                                                   "memory_efficient_linear": True}), 2)
