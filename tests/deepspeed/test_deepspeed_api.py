"""The DeepSpeed front door: `import zeropp as deepspeed` runs a
DeepSpeed script. Config semantics against DeepSpeed 0.19's documented and
measured numbers; the engine against zeropp's native API (same losses); the
two example scripts under torchrun and `zeropp launch`, resuming bit-exactly."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cases import batch, build, failed_run, loss_of

import zeropp
from zeropp.cli.launch import spawn
from zeropp.deepspeed import config as ds_config
from zeropp.deepspeed import lr_schedules
from zeropp.deepspeed.engine import LossScaler

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "deepspeed"


# ---- config: batch sizes, errors, warnings (no processes) ----------------------------
@pytest.mark.parametrize("given, expected", [
    ({"train_batch_size": 32}, (32, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 2}, (8, 2, 1)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}, (32, 2, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, (32, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, (24, 2, 3)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 3}, (24, 2, 3)),
])
def test_batch_size_rule_matches_deepspeed_at_world_4(given, expected):
    assert ds_config.batch_sizes(given, 4) == expected


@pytest.mark.parametrize("given, words", [
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 2}, "30"),       # gas 3: 24 != 30
    ({"train_batch_size": 33}, "33"),
    ({"train_batch_size": 3}, "(3)"),                                              # micro 0
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 3}, "gradient_accumulation_steps=3"),
    ({"gradient_accumulation_steps": 2}, "set train_batch_size or"),
    ({"train_batch_size": 0}, "train_batch_size=0"),
])
def test_inconsistent_batch_sizes_are_one_clear_error(given, words):
    with pytest.raises(ValueError) as e:
        ds_config.batch_sizes(given, 4)
    assert words in str(e.value) and "DeepSpeed config" in str(e.value)


def test_config_errors_name_the_key_and_unknown_keys_warn_once():
    base = {"train_batch_size": 8, "zero_optimization": {"stage": 3}}
    with pytest.raises(ValueError, match=r"zero_optimization.stage=2 is invalid; allowed: 3"):
        ds_config.parse({**base, "zero_optimization": {"stage": 2}}, 4)
    with pytest.raises(ValueError, match=r"gradient_clipping=-1"):
        ds_config.parse({**base, "gradient_clipping": -1}, 4)
    with pytest.raises(ValueError, match=r"fp16.loss_scale=-2"):
        ds_config.parse({**base, "fp16": {"enabled": True, "loss_scale": -2}}, 4)
    with pytest.raises(ValueError, match=r"fp16.initial_scale_power=-1"):
        ds_config.parse({**base, "fp16": {"enabled": True, "initial_scale_power": -1}}, 4)
    zero = ds_config.parse({**base, "fp16": {"enabled": True, "initial_scale_power": 0}}, 4)
    assert LossScaler(zero.fp16).scale == 1.0  # 2 ** 0, as DeepSpeed allows
    with pytest.raises(ValueError, match=r"zeropp.preset='zeropp-max' is invalid"):
        ds_config.parse({**base, "zeropp": {"preset": "zeropp-max"}}, 4)
    with pytest.raises(ValueError, match=r"optimizer.type='Lamb' is not supported"):
        from zeropp.deepspeed.compat import _config_optimizer
        _config_optimizer({"type": "Lamb", "params": {}}, [{"params": [torch.zeros(1)]}])
    with pytest.raises(ValueError, match=r"max_grad_norm is not supported; use the top-level"):
        _config_optimizer({"type": "AdamW", "params": {"max_grad_norm": 1}},
                          [{"params": [torch.zeros(1)]}])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ds = ds_config.parse({**base, "wall_clock_breakdown": False, "my_key": 1,
                              "zero_optimization": {"stage": 3, "overlap_comm": True,
                                                    "zero_quantized_weights": True, "oops": 1},
                              "fp16": {"enabled": False, "loss_scale_window": 10}}, 4)
    msgs = [str(x.message) for x in w]
    assert len(msgs) == 1 and "my_key" in msgs[0] and "zero_optimization.oops" in msgs[0], msgs
    assert "wall_clock_breakdown" not in msgs[0] and "overlap_comm" not in msgs[0]
    assert ds.zero.quantized_weights and ds.gradient_clipping == 1.0  # DeepSpeed 0.19 default
    plus = ds_config.parse({**base, "zeropp": {"preset": "zeropp-plus", "node_size": 2}}, 4)
    assert plus.zero.weight_delta and plus.zero.hierarchical_gather and plus.zero.node_size == 2
    # JSON names dtypes: {"param_dtype": "bfloat16"} is torch.bfloat16
    bf16 = ds_config.parse({**base, "zeropp": {"preset": "zeropp-plus", "node_size": 2,
                                               "param_dtype": "bfloat16"}}, 4)
    assert bf16.zero.param_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="zeropp.param_dtype=torch.int8 is invalid"):
        ds_config.parse({**base, "zeropp": {"param_dtype": "int8"}}, 4)


# ---- schedules and the loss scaler: DeepSpeed 0.19's values ---------------------------
def _lrs(cls, n, **kw):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.001)
    s = cls(opt, **kw)
    out = [opt.param_groups[0]["lr"]]  # t = -1, set at construction
    for _ in range(n):
        s.step()
        out.append(opt.param_groups[0]["lr"])
    return out


def test_warmup_schedules_match_deepspeed_values():
    lin = _lrs(lr_schedules.WarmupLR, 13, warmup_min_lr=0, warmup_max_lr=0.001,
               warmup_num_steps=10, warmup_type="linear")
    assert lin[:4] == [0, 0.0, 0.0001, 0.0002] and lin[11:] == [0.001, 0.001, 0.001]
    log = _lrs(lr_schedules.WarmupLR, 13, warmup_min_lr=0, warmup_max_lr=0.001,
               warmup_num_steps=10)
    assert log[2] == pytest.approx(0.00030102999566398113, rel=1e-12)
    assert log[10] == pytest.approx(0.0009999999999999998, rel=1e-12)
    decay = _lrs(lr_schedules.WarmupDecayLR, 22, total_num_steps=20, warmup_min_lr=0,
                 warmup_max_lr=0.001, warmup_num_steps=10, warmup_type="linear")
    assert decay[11] == 0.001 and decay[12] == pytest.approx(0.0009, rel=1e-12)
    assert decay[20] == pytest.approx(0.0001, rel=1e-12) and decay[21:] == [0.0, 0.0]
    cos = _lrs(lr_schedules.WarmupCosineLR, 22, total_num_steps=20, warmup_num_steps=5,
               warmup_min_ratio=0, cos_min_ratio=0.0001)
    assert cos[0] == 0.0 and cos[2] == pytest.approx(0.00043067655807339306, rel=1e-12)
    assert cos[7] == pytest.approx(0.0009567770515484183, rel=1e-12)
    assert cos[20] == pytest.approx(1.0000000000000001e-07, rel=1e-9)
    # WarmupLR's max defaults to the optimizer's lr (DeepSpeed 0.19).
    assert _lrs(lr_schedules.WarmupLR, 12, warmup_num_steps=10, warmup_type="linear")[-1] == 0.001
    with pytest.raises(ValueError, match="warmup_num_steps=10.0"):
        _lrs(lr_schedules.WarmupLR, 1, warmup_num_steps=10.0)


def test_dynamic_loss_scale_follows_deepspeeds_rule():
    s = LossScaler(ds_config.LossScaling(initial_scale_power=4, loss_scale_window=3,
                                         hysteresis=2, min_loss_scale=4))
    trace = []
    for overflow in [True, True, False, False, False, False, True, True, True]:
        s.update(overflow)
        trace.append(s.scale)
    # 16; hysteresis absorbs the first overflow, the second halves; 3 good steps
    # after it the scale doubles; then two overflows halve it to the floor.
    assert trace == [16, 8, 8, 8, 8, 16, 16, 8, 4]
    with pytest.raises(FloatingPointError, match="minimum loss scale 4"):
        s.update(True)


# ---- the engine against the native API, counters, checkpoints, GatheredParameters ----
def _config(**extra):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            "gradient_clipping": 0.5, "zero_optimization": {"stage": 3},
            "zeropp": {"node_size": 2}, **extra}


def _engine_run(tmp: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    # Native zeropp: the same settings by hand.
    model = zeropp.shard(build("gpt"), zeropp.Config(node_size=2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    native = []
    for step in range(5):
        for micro in range(2):
            x, y = batch("gpt", step, micro, world, rank)
            loss = loss_of("gpt", model, x, y)
            (loss / 2).backward()
            native.append(loss.item())
        zeropp.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad()
    out["native"] = native
    out["native_sd"] = zeropp.full_state_dict(model)

    engine, eopt, loader, sched = zeropp.initialize(model=build("gpt"), config=_config())
    assert loader is None and sched is None and eopt is engine.optimizer
    losses, trace = [], []
    for step in range(5):
        for micro in range(2):
            x, y = batch("gpt", step, micro, world, rank)
            boundary = engine.is_gradient_accumulation_boundary()
            loss = loss_of("gpt", engine, x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            trace.append((boundary, engine.was_step_applied(), engine.global_steps,
                          engine.global_samples, engine.micro_steps))
    out["engine"], out["trace"] = losses, trace
    out["engine_sd"] = zeropp.full_state_dict(engine.module)
    out["grad_norm"] = engine.get_global_grad_norm()
    out["sizes"] = (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                    engine.gradient_accumulation_steps(), engine.zero_optimization_stage(),
                    engine.bf16_enabled(), engine.fp16_enabled(), engine.world_size,
                    engine.global_rank, str(engine.device))

    # Checkpoint: client_state round trip, `latest`, resume equal to going on.
    gen = torch.Generator().manual_seed(rank)
    engine.save_checkpoint(tmp, client_state={"epoch": 3, "tag": "x", "rng": gen,
                                              "t": torch.arange(3) + rank})
    out["latest"] = (Path(tmp) / "latest").read_bytes()

    def two_steps(eng) -> list[float]:
        losses = []
        for micro in range(4):
            x, y = batch("gpt", 9, micro, world, rank)
            loss = loss_of("gpt", eng, x, y)
            eng.backward(loss)
            eng.step()
            losses.append(loss.item())
        return losses
    go_on = two_steps(engine)
    again, _, _, _ = zeropp.initialize(model=build("gpt"), config=_config())
    path, client = again.load_checkpoint(tmp)
    resumed = two_steps(again)
    out["resume"] = (go_on, resumed, again.global_steps, again.global_samples,
                     path.endswith("global_step5"))
    out["client"] = {k: (v.tolist() if isinstance(v, torch.Tensor) else
                         v.initial_seed() if isinstance(v, torch.Generator) else v)
                     for k, v in client.items()}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out["no_latest"] = (again.load_checkpoint(os.path.join(tmp, "nothing")),
                            any("no 'latest' file" in str(x.message) for x in w))

    # Schedule through the engine: optimizer step k runs at the lr of t = k - 2.
    eng2, opt2, _, _ = zeropp.initialize(model=build("gpt"), config=_config(
        scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                   "warmup_num_steps": 10,
                                                   "warmup_type": "linear"}}))
    used = []
    opt2.register_step_pre_hook(lambda o, a, k: used.append(o.param_groups[0]["lr"]))
    for step in range(4):
        for micro in range(2):
            x, y = batch("gpt", step, micro, world, rank)
            eng2.backward(loss_of("gpt", eng2, x, y))
            eng2.step()
    out["lrs_used"], out["lr_after"] = used, eng2.get_lr()

    # GatheredParameters: rank 0's edit reaches every shard; without modifier_rank none does.
    m = eng2.module
    with zeropp.zero.GatheredParameters(m.lm_head.weight, modifier_rank=0):
        with torch.no_grad():
            if rank == 0:
                m.lm_head.weight.fill_(0.25)
    with zeropp.zero.GatheredParameters(list(m.parameters())):
        with torch.no_grad():
            m.lm_head.weight.fill_(-1.0)  # discarded
    sd = zeropp.full_state_dict(m, all_ranks=True)
    out["gathered_edit"] = bool(torch.all(sd["lm_head.weight"] == 0.25))
    with zeropp.zero.GatheredParameters([torch.zeros(2)]):  # not ours: a no-op, as DeepSpeed
        pass

    # fp16: a huge initial scale overflows; the steps are skipped, the scale halves,
    # the schedule waits, and training then proceeds.
    eng3, _, _, _ = zeropp.initialize(model=build("gpt"), config=_config(
        fp16={"enabled": True, "initial_scale_power": 24, "hysteresis": 1},
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 5,
                                                   "warmup_type": "linear"}}))
    scales, applied, norms = [], [], []
    for step in range(12):
        for micro in range(2):
            x, y = batch("gpt", step, micro, world, rank)
            eng3.backward(loss_of("gpt", eng3, x, y))
            eng3.step()
        scales.append(eng3.loss_scale())
        applied.append(eng3.was_step_applied())
        norms.append(eng3.get_global_grad_norm())
    out["fp16"] = (scales, applied, eng3.skipped_steps, eng3.global_steps,
                   eng3.lr_scheduler.last_batch_iteration, norms)

    # Ranks that built different weights all start from rank 0's, as in DeepSpeed.
    mine = build("gpt")
    with torch.no_grad():
        for p in mine.parameters():
            p.add_(rank)
    eng4, _, _, _ = zeropp.initialize(model=mine, config=_config())
    sd4, ref = zeropp.full_state_dict(eng4.module), build("gpt").state_dict()
    out["broadcast"] = all(torch.equal(v, ref[k]) for k, v in sd4.items())
    return out


def _client_objects() -> dict:
    rank = dist.get_rank()
    out: dict = {}
    cfg = {k: v for k, v in _config().items() if k != "optimizer"}

    def lrs_used(engine, steps=4):
        used = []
        engine.optimizer.register_step_pre_hook(
            lambda o, a, k: used.append([g["lr"] for g in o.param_groups]))
        for step in range(steps):
            for micro in range(2):
                x, y = batch("gpt", step, micro, 4, rank)
                engine.backward(loss_of("gpt", engine, x, y))
                engine.step()
        return used

    # An AdamW instance with two param groups and a LambdaLR on it: rebuilt over the
    # shards with each group's settings; the schedule drives the rebuilt optimizer.
    model = build("gpt")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    eng, eopt, _, esched = zeropp.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                             config=cfg)
    # accelerate's DeepSpeedOptimizerWrapper asks `overflow` for skipped steps (its schedule
    # then holds) only if the optimizer has one when it wraps it, before any step.
    out["overflow_before_a_step"] = getattr(eopt, "overflow", None)
    out["adamw"] = (type(eopt).__name__, [g["weight_decay"] for g in eopt.param_groups],
                    esched is sched, lrs_used(eng))

    # A schedule initialize never sees (accelerate keeps one that is not DeepSpeed's, such
    # as transformers' get_linear_schedule_with_warmup, to itself): stepping it sets the
    # lr the engine steps with.
    model = build("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    unseen = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    eng, *_ = zeropp.initialize(model=model, optimizer=opt, config=cfg)
    unseen.step()
    out["unseen"] = lrs_used(eng, steps=1)

    # A SequentialLR (schedules inside a schedule) and, for reference, the same
    # schedule on a plain optimizer.
    def seq(o):
        return torch.optim.lr_scheduler.SequentialLR(o, [
            torch.optim.lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.5)], milestones=[2])
    model = build("gpt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng, _, _, _ = zeropp.initialize(model=model, optimizer=opt, lr_scheduler=seq(opt),
                                     config=cfg)
    ref_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    ref_sched, ref = seq(ref_opt), []
    for _ in range(4):
        ref.append([ref_opt.param_groups[0]["lr"]])
        ref_opt.step()
        ref_sched.step()
    out["sequential"] = (lrs_used(eng), ref)

    # A client schedule (a callable) and a config schedule: the client's wins, with a warning.
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        eng, _, _, esched = zeropp.initialize(
            model=build("gpt"), config={**_config(), "scheduler": {
                "type": "WarmupLR", "params": {"warmup_num_steps": 5}}},
            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.1))
    out["client_wins"] = (type(esched).__name__,
                          any("scheduler section is ignored" in str(x.message) for x in w))

    # GatheredParameters right after initialize, before any forward.
    eng, _, _, _ = zeropp.initialize(model=build("gpt"), config=_config())
    with zeropp.zero.GatheredParameters(eng.module.lm_head.weight, modifier_rank=0):
        with torch.no_grad():
            if rank == 0:
                eng.module.lm_head.weight.fill_(0.5)
    sd = zeropp.full_state_dict(eng.module, all_ranks=True)
    out["early_gather"] = bool(torch.all(sd["lm_head.weight"] == 0.5))

    # A model holding an already-sharded model is refused before anything is touched
    # (the sharded model itself may be initialized again: test_deepspeed_conformance).
    try:
        zeropp.initialize(model=torch.nn.Sequential(eng.module), config=_config())
    except ValueError as e:
        out["resharded"] = str(e)
    return out


def test_client_optimizer_and_schedules_drive_the_rebuilt_optimizer():
    res = spawn(_client_objects, 4, 2, timeout=300)
    for r in res:
        name, wds, same, used = r["adamw"]
        assert name == "AdamW" and wds == [0.1, 0.0] and same
        assert used == [[1e-3, 1e-3], [5e-4, 5e-4], [2.5e-4, 2.5e-4], [1.25e-4, 1.25e-4]]
        assert r["overflow_before_a_step"] is False  # (None: accelerate stepped its schedule
        # on all 6 of 6 fp16 overflow-skipped steps, last_epoch 12 where DeepSpeed's stays 0)
        assert r["unseen"] == [[5e-4]]  # the engine stepped at 1e-3 before the fix
        got, ref = r["sequential"]
        assert [x[0] for x in got] == pytest.approx([x[0] for x in ref], rel=1e-12)
        assert [x[0] for x in ref] == pytest.approx([0.05, 0.075, 0.1, 0.05], rel=1e-12)
        assert r["client_wins"] == ("StepLR", True)
        assert r["early_gather"]
        assert "a submodule of this model is already sharded" in r["resharded"]


def test_engine_equals_native_api_and_keeps_deepspeeds_counters(tmp_path):
    res = spawn(_engine_run, 4, 2, args=(str(tmp_path / "ck"),), timeout=300)
    r0 = res[0]
    for r in res:
        assert r["engine"] == pytest.approx(r["native"], rel=1e-5, abs=0)
        if r is r0:
            for k, v in r["native_sd"].items():
                assert torch.allclose(v, r["engine_sd"][k], rtol=1e-5, atol=1e-7), k
        # gas 2: boundaries on every second micro-step; counters as DeepSpeed's.
        assert [t[0] for t in r["trace"]] == [False, True] * 5
        assert [t[1] for t in r["trace"]] == [False, True] * 5
        assert r["trace"][-1][2:] == (5, 5 * 16, 10)
        assert r["sizes"] == (16, 2, 2, 3, False, False, 4, r["sizes"][7], "cpu")
        go_on, resumed, steps, samples, named = r["resume"]
        assert resumed == go_on and steps == 7 and samples == 7 * 16 and named
        assert r["client"]["epoch"] == 3 and r["client"]["tag"] == "x"
        assert r["client"]["t"] == (torch.arange(3) + r["sizes"][7]).tolist()
        assert r["client"]["rng"] == r["sizes"][7]
        assert r["no_latest"] == ((None, None), True)
        # WarmupLR linear 0 -> 1e-3 over 10: steps 1..4 run at f(-1), f(0), f(1), f(2).
        assert r["lrs_used"] == pytest.approx([0, 0.0, 1e-4, 2e-4], abs=1e-12)
        assert r["lr_after"] == pytest.approx([3e-4], abs=1e-12)
        assert r["gathered_edit"]
        scales, applied, skipped, steps, t, norms = r["fp16"]
        assert skipped >= 1 and scales[0] == 2.0 ** 23 and steps == 12, r["fp16"]
        # An overflowed step keeps the last applied step's norm (DeepSpeed's ZeRO-3 returns
        # before taking one): None before the first, finite after it.
        assert all(n == ([None] + norms)[i] if not a else math.isfinite(n)
                   for i, (n, a) in enumerate(zip(norms, applied))), (applied, norms)
        assert applied[-3:] == [True] * 3 and scales[-1] == scales[-3] < scales[0]
        assert t == 12 - skipped - 1  # the schedule advanced only on applied steps
    assert r0["latest"] == b"global_step5" and r0["broadcast"]
    assert math.isfinite(r0["grad_norm"]) and r0["grad_norm"] > 0


# ---- the example scripts, unchanged but for the import ---------------------------------
def _losses(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+ loss (\S+)", text, re.M)]


def _run(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1",
                            "PYTHONFAULTHANDLER": "1"})  # a crash shows its Python stacks
    assert r.returncode == 0, failed_run(r.stdout, r.stderr)
    return r.stdout


def _torchrun(script: str, cfg: Path, *args: str) -> str:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return _run([torchrun, "--standalone", "--nproc-per-node", "4", str(EXAMPLES / script),
                 "--deepspeed", "--deepspeed_config", str(cfg), *args])


def _launch(script: str, cfg: Path, *args: str) -> str:
    return _run([sys.executable, "-m", "zeropp", "launch", "--nproc", "4", "--node-size", "2",
                 "--timeout", "500", str(EXAMPLES / script), "--deepspeed_config", str(cfg),
                 *args])


@pytest.mark.parametrize("script, config, steps", [
    ("cifar_cnn.py", "ds_config_cnn.json", 32),  # the loss at 0.46x by 32 (bound 0.6)
    ("transformer_lm.py", "ds_config_lm.json", 30),
])
def test_example_runs_under_torchrun_and_zeropp_launch_and_resumes_bit_exactly(
        tmp_path, script, config, steps):
    # The 2x2 layout on one machine: torchrun says 4 ranks per node, the config 2.
    cfg = tmp_path / config
    cfg.write_text(json.dumps({**json.loads((EXAMPLES / config).read_text()),
                               "zeropp": {"node_size": 2}}))
    export = ["--export", str(tmp_path / "export")] if script == "transformer_lm.py" else []
    ck, half = tmp_path / "ck", steps // 2
    full = _losses(_torchrun(script, cfg, "--steps", str(steps), "--save_dir", str(ck),
                             "--save_every", str(half), *export))
    assert len(full) == steps
    if export:  # save_16bit_model: rank 0 wrote the bf16 weights under the original names
        sd = torch.load(tmp_path / "export" / "pytorch_model.bin", weights_only=True)
        assert "blocks.1.mlp.0.weight" in sd and sd["head.weight"].dtype == torch.bfloat16
        assert sd["blocks.0.qkv.weight"].shape == (192, 64)
    assert sum(full[-5:]) / 5 < 0.6 * sum(full[:5]) / 5, full  # the loss falls
    assert (ck / "latest").read_text() == f"global_step{steps}"
    # back to the middle tag, as a DeepSpeed user does by editing `latest`
    (ck / "latest").write_text(f"global_step{half}")
    rest = _losses(_launch(script, cfg, "--steps", str(steps), "--save_dir", str(ck),
                           "--resume"))
    assert rest == full[half:]  # torchrun straight, zeropp launch resumed: the same bits
