"""DeepSpeed's script surface beyond initialize: `deepspeed.accelerator`,
`deepspeed.comm`, `zero.ZeroParamStatus` / `ds_status`, the engine's ZeRO-3
methods (config dict, consolidated 16-bit state dict, partition cache), per-rank
client_state in checkpoints, the config keys Hugging Face writes ("auto", inf,
dotted keys) and the one-line refusals of features zeropp does not have."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from cases import batch, build, loss_of

import zeropp
from zeropp.cli.launch import spawn
from zeropp.deepspeed import config as ds_config
from zeropp.shard import get_state

CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 3}}


# ---- accelerator -----------------------------------------------------------------------
def test_cpu_accelerator_answers_deepspeeds_questions():
    from zeropp.accelerator import get_accelerator
    acc = get_accelerator()
    assert acc.device_name() == "cpu" and acc.device_name(0) == "cpu"
    assert acc.current_device_name() == "cpu" and acc.device(3) == torch.device("cpu")
    assert acc.communication_backend_name() == "gloo" and acc.is_available()
    assert acc.is_bf16_supported() and torch.bfloat16 in acc.supported_dtypes()
    assert acc.on_accelerator(torch.zeros(1)) and not acc.is_pinned(torch.zeros(1))
    acc.set_device(0)
    acc.synchronize()
    acc.manual_seed_all(5)
    a = torch.rand(3)
    acc.manual_seed(5)
    assert torch.equal(a, torch.rand(3))
    with acc.stream(acc.Stream()):
        e = acc.Event()
        e.record()
        e.synchronize()
    assert acc.FloatTensor(2, 3).shape == (2, 3) and acc.LongTensor([1, 2]).dtype == torch.int64


def test_cpu_peak_memory_resets_and_sees_a_256_mb_allocation():
    from zeropp.accelerator import get_accelerator
    acc = get_accelerator()
    acc.reset_peak_memory_stats()
    base = acc.max_memory_allocated()
    x = torch.ones(64 * 2**20)  # 256 MiB, touched
    peak = acc.max_memory_allocated()
    del x
    assert peak - base >= 200 * 2**20, (base, peak)
    assert acc.memory_allocated() > 0 and acc.total_memory() > peak


def test_unknown_accelerator_is_one_clear_error(monkeypatch):
    from zeropp.deepspeed import accelerator as a
    monkeypatch.setattr(a, "_accelerator", None)
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match="'xpu' is not supported; allowed: cuda, cpu"):
        a.get_accelerator()


# ---- config keys Hugging Face writes, and refusals ----------------------------------------
def test_hf_config_values_inf_dotted_keys_and_zero_section_auto_are_accepted():
    ds = ds_config.parse({"train_micro_batch_size_per_gpu": 2, "steps_per_print": float("inf"),
                          "zero_optimization.reduce_bucket_size": 4096.0,
                          "zero_optimization": {"stage": 3, "offload_param": {"device": "none"},
                                                "stage3_prefetch_bucket_size": "auto"},
                          "bf16": {"enabled": "auto"}}, 2)
    assert (ds.micro_batch, ds.grad_accum, ds.train_batch_size) == (2, 1, 4)
    assert ds.steps_per_print is None and not ds.bf16  # DeepSpeed's defaults


@pytest.mark.parametrize("key, cfg", [
    ("gradient_clipping", {"gradient_clipping": "auto"}),
    ("optimizer.params.lr", {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}),
    ("scheduler.params.warmup_max_lr",
     {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}}),
])
def test_an_unfilled_auto_outside_the_zero_section_is_an_error_naming_it(key, cfg):
    # DeepSpeed fails on these too; training at a default lr would be silently wrong.
    with pytest.raises(ValueError, match=f'{re.escape(key)}="auto" was not filled'):
        ds_config.parse({"train_batch_size": 4, "zero_optimization": {"stage": 3}, **cfg}, 2)


def test_zeropp_ds_config_is_merged_over_the_scripts_config(monkeypatch):
    monkeypatch.setenv("ZEROPP_DS_CONFIG", '{"zero_optimization": {"stage": 3, '
                       '"zero_quantized_weights": true}, "gradient_clipping": 0.5}')
    ds = ds_config.parse({"train_batch_size": 4, "gradient_clipping": 1.0,
                          "zero_optimization": {"stage": 1, "overlap_comm": True}}, 2)
    assert ds.zero.quantized_weights and ds.gradient_clipping == 0.5
    monkeypatch.setenv("ZEROPP_DS_CONFIG", "{not json")
    with pytest.raises(ValueError, match="ZEROPP_DS_CONFIG: not a JSON object"):
        ds_config.parse({"train_batch_size": 4}, 2)


@pytest.mark.parametrize("extra, words", [
    ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage=2 is invalid; allowed: 3"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer.device='cpu' is not supported"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     "zero_optimization.offload_param.device='nvme' is not supported"),
    ({"pipeline": {"stages": 2}}, "pipeline is not supported (pipeline parallelism"),
    ({"moe": {"enabled": True}}, "moe is not supported (Mixture-of-Experts"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel is not supported"),
    ({"sequence_parallel_size": 2}, "sequence_parallel_size is not supported"),
    ({"amp": {"enabled": True}}, "amp is not supported (apex AMP"),
])
def test_unsupported_deepspeed_features_are_one_line_naming_the_key(extra, words):
    with pytest.raises(ValueError) as e:
        ds_config.parse({"train_batch_size": 4, **extra}, 2)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_refused_key_ends_the_script_with_one_line_not_a_traceback(tmp_path):
    import subprocess
    import sys
    code = ("import torch, zeropp\n"
            "zeropp.initialize(model=torch.nn.Linear(2, 2), config={'train_batch_size': 1, "
            "'zero_optimization': {'stage': 3, 'offload_optimizer': {'device': 'cpu'}}})\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.strip() == (
        "DeepSpeedConfigError: DeepSpeed config: zero_optimization.offload_optimizer.device='cpu' is not "
        "supported (zeropp has no ZeRO-Offload); allowed: \"none\"")


# ---- distributed: comm, engine methods, ds_status, per-rank client_state -----------------
def _surface_worker(ckpt: str) -> dict:
    import zeropp.comm as comm
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"rank": comm.get_rank(), "world": comm.get_world_size(),
                 "local": comm.get_local_rank(), "init": comm.is_initialized()}
    t = torch.tensor([float(rank + 1)])
    comm.all_reduce(t)
    out["all_reduce"] = t.item()
    b = torch.tensor([float(rank)])
    comm.broadcast(b, src=1)
    out["broadcast"] = b.item()
    parts = [torch.zeros(1) for _ in range(world)]
    comm.all_gather(parts, torch.tensor([float(rank * 10)]))
    out["all_gather"] = [p.item() for p in parts]
    comm.barrier(log_name="barrier", prof=False)  # DeepSpeed's profiling keywords
    out["world_group"] = comm.get_world_group() is dist.group.WORLD
    objs = [None] * world  # the rest of DeepSpeed's comm that scripts call
    comm.all_gather_object(objs, {"r": rank})
    names = [f"from{rank}"]
    comm.broadcast_object_list(names, src=1)
    ts = [torch.tensor([float(rank)]), torch.tensor([2.0 * rank])]
    comm.all_reduce_coalesced(ts)
    a2a = [torch.zeros(1) for _ in range(world)]
    comm.all_to_all(a2a, [torch.tensor([float(10 * rank + j)]) for j in range(world)])
    out["more_comm"] = (objs, names, [t.item() for t in ts], [t.item() for t in a2a],
                        comm.get_all_ranks_from_group(), comm.has_all_gather_into_tensor())

    # (No persistent parameters: the lifecycle below is that of a partitioned one.)
    zo = {"stage": 3, "stage3_param_persistence_threshold": 0}
    eng, _, _, _ = zeropp.initialize(model=build("gpt"), config={**CFG, "zero_optimization": zo})
    out["config_is_dict"] = eng.config["zero_optimization"] == zo
    out["gather_on_save"] = eng.zero_gather_16bit_weights_on_model_save()
    status = zeropp.zero.ZeroParamStatus
    # ds_status: NOT_AVAILABLE at rest, AVAILABLE inside the unit's forward and under
    # GatheredParameters, NOT_AVAILABLE again after.
    w = eng.module.h[0].attn.qkv  # a Linear inside the first block unit
    out["rest"] = w.weight.ds_status == status.NOT_AVAILABLE
    held = w.weight  # a reference kept across gathers must not go stale
    inside = []
    h = w.register_forward_pre_hook(lambda m, a: inside.append(m.weight.ds_status))
    x, y = batch("gpt", 0, 0, world, rank)
    loss = loss_of("gpt", eng, x, y)
    h.remove()
    out["in_forward"] = inside == [status.AVAILABLE]
    eng.backward(loss)
    eng.step()
    out["after_step"] = w.weight.ds_status == held.ds_status == status.NOT_AVAILABLE
    with zeropp.zero.GatheredParameters(eng.module.parameters()):  # TRL's generation context
        out["gathered"] = w.weight.ds_status == status.AVAILABLE
        zeropp.reset_comm_stats(eng.module)
        with torch.no_grad():
            for _ in range(3):  # "tokens": no collective per forward
                eng(x)
        st = zeropp.comm_stats(eng.module)
        out["per_token_bytes"] = st["inter_node_bytes"] + st["intra_node_bytes"]
    # Outside a gather a ZeRO-3 parameter shows 0 elements; ds_shape is its shape.
    with zeropp.zero.GatheredParameters(w.weight):
        gathered_shape = tuple(w.weight.shape)
    out["ds_shape"] = (tuple(w.weight.ds_shape) == gathered_shape and w.weight.numel() == 0)
    # The consolidated 16-bit state dict: rank 0 gets full_state_dict's values, others None;
    # the tied head one tensor with the embedding, as DeepSpeed's (savers write it once).
    sd = eng._zero3_consolidated_16bit_state_dict()
    full = zeropp.full_state_dict(eng.module)
    out["consolidated"] = (sd is None) if rank else (
        sd.keys() == full.keys() and all(torch.equal(sd[k], full[k]) for k in sd)
        and sd["lm_head.weight"] is sd["wte.weight"])
    eng.save_16bit_model(f"{ckpt}16", "model.safetensors")  # (safetensors: one copy per name)
    if rank == 0:
        from safetensors.torch import load_file
        st = load_file(f"{ckpt}16/model.safetensors")
        out["consolidated"] &= st.keys() == full.keys() and torch.equal(st["lm_head.weight"],
                                                                         full["wte.weight"])
    # The partition cache: nothing gathered after it, and training goes on.
    eng.empty_partition_cache()
    out["cache_empty"] = all(not f.gathered for f in get_state(eng.module).flats)
    eng.destroy()
    loss = loss_of("gpt", eng, *batch("gpt", 1, 0, world, rank))
    eng.backward(loss)
    eng.step()
    with pytest.raises(NotImplementedError, match="DeepCompile's schedule"):
        eng.compile(schedule=[(0, ["prefetch"])])  # (engine.compile() itself: test_compile.py)
    assert not eng.is_compiled
    # Per-rank client_state: every rank gets its own values back.
    gen = torch.Generator().manual_seed(100 + rank)
    eng.save_checkpoint(ckpt, client_state={"rank_value": rank, "name": f"r{rank}",
                                            "t": torch.full((2,), float(rank)), "gen": gen,
                                            "nested": {"k": [rank, rank * 2]}})
    _, cs = eng.load_checkpoint(ckpt)
    out["client"] = (cs["rank_value"], cs["name"], cs["t"].tolist(), cs["nested"],
                     torch.equal(cs["gen"].get_state(), gen.get_state()))
    return out


def _load_elsewhere_worker(ckpt: str) -> dict:
    eng, _, _, _ = zeropp.initialize(model=build("gpt"), config=CFG)
    with pytest.warns(UserWarning, match="per-rank tensors were not restored"):
        _, cs = eng.load_checkpoint(ckpt)
    return cs


def test_comm_engine_methods_ds_status_and_per_rank_client_state(tmp_path):
    rs = spawn(_surface_worker, 2, args=(str(tmp_path / "ck"),), timeout=300)
    for r, o in enumerate(rs):
        assert (o["rank"], o["world"], o["local"], o["init"]) == (r, 2, r, True)
        assert o["all_reduce"] == 3.0 and o["broadcast"] == 1.0 and o["all_gather"] == [0, 10]
        assert o["world_group"] and o["config_is_dict"] and o["gather_on_save"]
        assert o["rest"] and o["in_forward"] and o["after_step"] and o["gathered"]
        assert o["ds_shape"] and o["consolidated"] and o["cache_empty"]
        assert o["per_token_bytes"] == 0
        assert o["more_comm"] == ([{"r": 0}, {"r": 1}], ["from1"], [1.0, 2.0], [r, 10 + r],
                                  [0, 1], True)
        assert o["client"] == (r, f"r{r}", [float(r)] * 2, {"k": [r, 2 * r]}, True)
    # At another world size ranks do not map: rank 0's JSON values, no per-rank tensors.
    cs = spawn(_load_elsewhere_worker, 1, args=(str(tmp_path / "ck"),), timeout=300)[0]
    assert cs == {"rank_value": 0, "name": "r0", "nested": {"k": [0, 0]}}


def test_a_deepspeed_comm_name_zeropp_lacks_is_an_attribute_error_naming_it():
    import zeropp.deepspeed.comm as comm
    with pytest.raises(AttributeError, match="deepspeed.comm.mpi_discovery is not provided"):
        _ = comm.mpi_discovery
    assert not hasattr(comm, "in_aml")
