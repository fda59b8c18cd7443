"""Sharded checkpoints: exact resume, resharding, atomic saves, verified and safe loads.

Each distributed run is a fresh `spawn` (a new process group), as a restart is.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import warnings

import pytest
import torch
from cases import build, loss_of

import zeropp
from zeropp import CheckpointError
from zeropp.cli.export import consolidate
from zeropp.cli.launch import WorkerError, spawn

GPT_ZEROPP = dict(quantized_weights=True, hpz_partition_size=2, quantized_gradients=True)
# zeropp-plus: qWD copies and error-feedback residuals are engine state that a resume
# must restore.
GPT_PLUS = dict(GPT_ZEROPP, hierarchical_gather=True, weight_delta=True,
                gradient_error_feedback=True)


def _model(kw: dict) -> torch.nn.Module:
    # Earlier tests' models collected now, not inside this one's optimizer step: there, their
    # step hooks' removal (buffer.py's finalizer) changes the dict torch loops over (a known bug).
    gc.collect()
    return zeropp.shard(build("gpt"), zeropp.Config(**kw))


def _steps(model, opt, gen, n: int) -> list[float]:
    """n AdamW steps on random tokens drawn from `gen` (this rank's data stream)
    and the global RNG (a random dropout-like mask), so resuming must restore both."""
    losses = []
    for _ in range(n):
        x = torch.randint(0, 64, (2, 16), generator=gen)
        x = torch.where(torch.rand(x.shape) < 0.1, torch.zeros_like(x), x)  # global RNG
        loss = loss_of("gpt", model, x, x.roll(1, dims=1))
        loss.backward()
        zeropp.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _start(kw: dict):
    model = _model(kw)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    torch.manual_seed(7 + torch.distributed.get_rank())
    return model, opt, gen


def _straight(kw: dict, n: int) -> list[float]:
    model, opt, gen = _start(kw)
    return _steps(model, opt, gen, n)


def _first_half(kw: dict, n: int, path: str) -> list[float]:
    model, opt, gen = _start(kw)
    losses = _steps(model, opt, gen, n)
    zeropp.save_checkpoint(path, model, opt, step=n, data_gen=gen)
    return losses


def _straight_then_first_half(kw: dict, n: int, path: str) -> tuple[list[float], list[float]]:
    """2n steps straight, then n of a fresh model, saved (one world for both)."""
    return _straight(kw, 2 * n), _first_half(kw, n, path)


# Fields that change when work happens, never the numbers (zeropp.config.SCHEDULE_ONLY).
RESCHEDULED = dict(prefetch_depth=2, async_reduce=False, reduce_buckets=2, collective_timeout=600.0)


def _second_half(kw: dict, n: int, path: str) -> tuple[list[float], int, list[str], list[str]]:
    """Resumed under RESCHEDULED; then the checkpoint loaded into a model with error
    feedback flipped. Returns the losses, the step and each load's warnings."""
    model, opt, gen = _start(dict(kw, **RESCHEDULED))
    torch.manual_seed(999)  # must be overwritten by the checkpoint's RNG state
    with warnings.catch_warnings(record=True) as same:
        warnings.simplefilter("always")
        extra = zeropp.load_checkpoint(path, model, opt, data_gen=gen)
    losses = _steps(model, opt, gen, n)
    other = _model(dict(kw, gradient_error_feedback=not kw.get("gradient_error_feedback")))
    with warnings.catch_warnings(record=True) as flipped:
        warnings.simplefilter("always")
        zeropp.load_checkpoint(path, other)
    return losses, extra["step"], [str(w.message) for w in same], [str(w.message) for w in flipped]


@pytest.mark.parametrize("kw", [{}, GPT_ZEROPP, GPT_PLUS],
                         ids=["compression-off", "qwz+hpz+qgz", "zeropp-plus"])
def test_resume_after_6_steps_gives_the_12_step_losses_bit_for_bit(tmp_path, kw):
    """In a new world of processes; also under other prefetch depth, reduce pipeline and
    timeout (they keep qWD copies and error-feedback residuals, silently); a checkpoint
    whose engine state a config change drops says so in one warning naming the field."""
    ck = str(tmp_path / "ck")
    straight, first = spawn(_straight_then_first_half, 4, 2, args=(kw, 6, ck), timeout=240)[0]
    second, step, same, flipped = spawn(_second_half, 4, 2, args=(kw, 6, ck), timeout=240)[0]
    assert step == 6
    assert first == straight[:6]
    assert second == straight[6:]  # exact float equality, every step
    assert same == []
    assert flipped == ([f"zeropp: {ck} was saved with another gradient_error_feedback: its qWD "
                        "copies and error-feedback residuals are not restored"]
                       if kw is GPT_PLUS else [])  # (no engine state saved: nothing dropped)


# ---- resharding ---------------------------------------------------------------------
def _save_after(kw: dict, n: int, path: str) -> dict:
    model, opt, gen = _start(kw)
    _steps(model, opt, gen, n)
    zeropp.save_checkpoint(path, model, opt)
    return zeropp.full_state_dict(model)


def _load_resave(kw: dict, src: str, dst: str) -> tuple[dict, float, list[str]]:
    import warnings
    model, opt, gen = _start(kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zeropp.load_checkpoint(src, model, opt)
    full = zeropp.full_state_dict(model)
    zeropp.save_checkpoint(dst, model, opt)
    loss = _steps(model, opt, gen, 1)[0]  # the resharded optimizer state steps
    return full, loss, [str(w.message) for w in caught]


def test_saved_at_4_ranks_loads_at_2_and_3_with_equal_weights_and_optimizer_state(tmp_path):
    kw = dict(GPT_ZEROPP, hpz_partition_size=1)  # hpZ must divide W=3
    a, b, c = (str(tmp_path / n) for n in "abc")
    full4 = spawn(_save_after, 4, 2, args=(kw, 3, a), timeout=240)[0]
    full2, loss2, warned = spawn(_load_resave, 2, 2, args=(kw, a, b), timeout=240)[0]
    assert any("world size 4, loaded at 2" in w for w in warned)
    full3, loss3, _ = spawn(_load_resave, 3, 3, args=(kw, b, c), timeout=240)[0]
    assert sorted(full2) == sorted(full4) == sorted(full3)
    for k in full4:
        assert torch.equal(full2[k], full4[k]) and torch.equal(full3[k], full4[k]), k
    opt4, opt3 = consolidate(a, optimizer_state=True), consolidate(c, optimizer_state=True)
    assert sorted(opt4) == sorted(opt3) and any(k.endswith("/exp_avg_sq") for k in opt4)
    for k in opt4:
        assert torch.equal(opt4[k], opt3[k]), k
    assert torch.isfinite(torch.tensor([loss2, loss3])).all()


# ---- hpZ secondaries after a load ---------------------------------------------------
def _load_over_live_secondaries(kw: dict, path: str, dirty: bool) -> list[float]:
    model, opt, gen = _start(kw)
    if dirty:  # train on, then forward+backward without a step: secondaries are held
        _steps(model, opt, gen, 3)
        x = torch.randint(0, 64, (2, 16), generator=gen)
        loss_of("gpt", model, x, x).backward()
        assert any(f.buffer.secondary_bytes for f in model._zeropp_state.flats)
    zeropp.load_checkpoint(path, model, opt, data_gen=gen)
    return _steps(model, opt, gen, 3)


def test_hpz_secondaries_are_rebuilt_from_loaded_weights(tmp_path):
    kw = GPT_ZEROPP
    spawn(_first_half, 4, 2, args=(kw, 2, str(tmp_path / "ck")), timeout=240)
    clean = spawn(_load_over_live_secondaries, 4, 2, args=(kw, str(tmp_path / "ck"), False),
                  timeout=240)[0]
    dirty = spawn(_load_over_live_secondaries, 4, 2, args=(kw, str(tmp_path / "ck"), True),
                  timeout=240)[0]
    assert dirty == clean


# ---- failures during save and load --------------------------------------------------
def _save_then_die_in_second_save(path: str, ref: str) -> None:
    from safetensors.torch import save_file

    import zeropp.checkpoint as ck
    model, opt, gen = _start({})
    _steps(model, opt, gen, 2)
    zeropp.save_checkpoint(path, model, opt)
    full = zeropp.full_state_dict(model, all_ranks=True)
    if torch.distributed.get_rank() == 0:
        save_file(full, ref)
    _steps(model, opt, gen, 2)
    if torch.distributed.get_rank() == 0:  # die after the files, before the rename
        ck._move_into_place = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    zeropp.save_checkpoint(path, model, opt)


def _load_full(path: str) -> dict:
    model, opt, _ = _start({})
    zeropp.load_checkpoint(path, model, opt)
    return zeropp.full_state_dict(model)


def test_a_save_killed_halfway_leaves_the_previous_checkpoint_loadable(tmp_path):
    from safetensors.torch import load_file
    path, ref = str(tmp_path / "ck"), str(tmp_path / "ref.safetensors")
    with pytest.raises(WorkerError):  # rank 0 died; rank 1 may notice first (peer reset)
        spawn(_save_then_die_in_second_save, 2, 2, args=(path, ref), timeout=240)
    assert (tmp_path / ".ck.partial" / "rank00001.safetensors").exists()  # died mid-save
    full = spawn(_load_full, 2, 2, args=(path,), timeout=240)[0]
    expected = load_file(ref)
    assert sorted(full) == sorted(expected)
    assert all(torch.equal(full[k], expected[k]) for k in full)


def _single(tmp_path, kw=None):
    """A W=1 sharded model, one step trained, saved at tmp_path/ck."""
    model = _model(kw or {})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    loss_of("gpt", model, x, x).backward()
    opt.step()
    opt.zero_grad()
    zeropp.save_checkpoint(tmp_path / "ck", model, opt, step=1)
    return model, opt


def test_a_crash_between_the_two_renames_loads_the_previous_checkpoint(tmp_path, monkeypatch):
    import zeropp.checkpoint as ck
    model, opt = _single(tmp_path)
    before = zeropp.full_state_dict(model)
    renames, real_rename = [], os.rename

    def rename_once(a, b):  # the first rename happens, then the process "dies"
        if renames:
            raise KeyboardInterrupt
        renames.append((a, b))
        real_rename(a, b)
    monkeypatch.setattr(ck.os, "rename", rename_once)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        zeropp.save_checkpoint(tmp_path / "ck", model, opt, step=2)
    monkeypatch.undo()
    assert not (tmp_path / "ck").exists() and (tmp_path / ".ck.old").exists()
    extra = zeropp.load_checkpoint(tmp_path / "ck", model, opt)
    assert extra["step"] == 1
    after = zeropp.full_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def _load_message(path: str) -> tuple[str, bool]:
    """The load's error, and whether the data generator passed to it kept its state (on rank 0
    the load read its own file and restored it before learning of rank 1's failure)."""
    model, opt, gen = _start({})
    before = gen.get_state()
    try:
        zeropp.load_checkpoint(path, model, opt, data_gen=gen)
    except CheckpointError as e:
        return str(e), torch.equal(gen.get_state(), before)
    return "loaded", False


@pytest.mark.parametrize("damage", ["truncate", "alter"])
def test_a_damaged_shard_file_is_named_on_every_rank(tmp_path, damage):
    path = tmp_path / "ck"
    spawn(_first_half, 2, 2, args=({}, 1, str(path)), timeout=240)
    f = path / "rank00001.safetensors"
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        data = data[:len(data) // 2]
    else:
        data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    messages = spawn(_load_message, 2, 2, args=(str(path),), timeout=240)
    for m, gen_untouched in messages:  # rank 0 never reads rank 1's file, yet reports it too
        assert "rank00001.safetensors" in m
        assert ("truncated" if damage == "truncate" else "sha256 differs") in m
        assert gen_untouched


class _Evil:
    """Unpickling this would create a marker file: proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_of_pickles_is_refused_and_runs_no_code(tmp_path):
    model, opt = _single(tmp_path)
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Evil(str(marker)))
    ck = tmp_path / "ck"
    for name in ("rank00000.safetensors", "manifest.json"):
        (ck / name).write_bytes(evil)
    with pytest.raises(CheckpointError, match="manifest.json is not a JSON manifest"):
        zeropp.load_checkpoint(ck, model, opt)
    # An intact manifest over a pickled shard: the checksum, then the parser, refuse it.
    _single(tmp_path)
    (ck / "rank00000.safetensors").write_bytes(evil)
    with pytest.raises(CheckpointError, match="rank00000.safetensors"):
        zeropp.load_checkpoint(ck, model, opt)
    # A bare pickle where a checkpoint should be, and a directory of torch.save files.
    (tmp_path / "model.pt").write_bytes(evil)
    with pytest.raises(CheckpointError, match="is a file"):
        zeropp.load_checkpoint(tmp_path / "model.pt", model, opt)
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "pytorch_model.bin").write_bytes(evil)
    with pytest.raises(CheckpointError, match="no manifest.json"):
        zeropp.load_checkpoint(tmp_path / "legacy", model, opt)
    assert not marker.exists()


def test_loading_into_a_different_model_names_the_first_difference(tmp_path):
    from zeropp.train.model import GPT, GPTConfig
    _single(tmp_path)
    other = zeropp.shard(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2,
                                       n_embd=48, bias=False)))
    with pytest.raises(CheckpointError, match=r"'wte.weight' has shape \(64, 32\) in the "
                                              r"checkpoint and \(64, 48\) in the model"):
        zeropp.load_checkpoint(tmp_path / "ck", other)
    fewer = zeropp.shard(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2,
                                       n_embd=32, bias=False)))
    with pytest.raises(CheckpointError, match=r"the checkpoint's 'h.3.ln_1.weight' \(32,\) is not in the model"):
        zeropp.load_checkpoint(tmp_path / "ck", fewer)


def _without(path, key: str) -> None:
    """The rank file at `path` rewritten without tensor `key`, the manifest's hash of it
    updated: it verifies, and lacks one tensor."""
    import json

    from zeropp.checkpoint_files import RankFile, write_safetensors
    rf = RankFile(path)
    tensors = {k: rf.get_tensor(k) for k in rf.keys() if k != key}
    sha, n = write_safetensors(path, tensors, rf.metadata())
    man = json.loads((path.parent / "manifest.json").read_text())
    man["files"][path.name] = {"sha256": sha, "bytes": n}
    (path.parent / "manifest.json").write_text(json.dumps(man))


@pytest.mark.parametrize("damage", ["garbage", "no torch rng state"])
def test_a_failed_load_leaves_the_model_untouched(tmp_path, damage):
    """A file that is not safetensors, or one that verifies but lacks the torch RNG state
    (read last, after the weights, before this was checked up front)."""
    model, opt = _single(tmp_path)
    before = zeropp.full_state_dict(model)
    rank_file = tmp_path / "ck" / "rank00000.safetensors"
    if damage == "garbage":
        rank_file.write_bytes(b"0" * 10)
    else:
        _without(rank_file, "rng/torch")
    with pytest.raises(CheckpointError, match="truncated or replaced" if damage == "garbage"
                       else "no tensor 'rng/torch'"):
        zeropp.load_checkpoint(tmp_path / "ck", model, opt)
    after = zeropp.full_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_extras_round_trip_json_tensors_generators_and_schedulers(tmp_path):
    model = _model({})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        opt.step()
        sched.step()
    gen = torch.Generator().manual_seed(3)
    gen_next = torch.rand(4, generator=torch.Generator().manual_seed(3))
    zeropp.save_checkpoint(tmp_path / "ck", model, opt, step=3, sched=sched, gen=gen,
                           t=torch.arange(5), tags={"a": [1, 2]})
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    extra = zeropp.load_checkpoint(tmp_path / "ck", model, opt2, sched=sched2)
    assert extra["step"] == 3 and extra["tags"] == {"a": [1, 2]}
    assert torch.equal(extra["t"], torch.arange(5))
    assert torch.equal(torch.rand(4, generator=extra["gen"]), gen_next)
    assert sched2.last_epoch == 3 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    with pytest.raises(CheckpointError, match="extra 'bad': a object cannot be saved"):
        zeropp.save_checkpoint(tmp_path / "ck2", model, opt, bad=object())


def test_an_extra_that_does_not_load_fails_the_load_with_nothing_changed(tmp_path):
    """A StepLR saved, a LambdaLR passed to restore it: a CheckpointError naming the extra, and
    the model, optimizer and the Generator restored before it as they were."""
    model, opt = _single(tmp_path)
    zeropp.save_checkpoint(tmp_path / "ck", model, opt, gen=torch.Generator().manual_seed(1),
                           sched=torch.optim.lr_scheduler.StepLR(opt, 2))
    model2 = _model({})
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    gen2, sched2 = torch.Generator().manual_seed(2), torch.optim.lr_scheduler.LambdaLR(
        opt2, lambda s: 1.0)
    before, gen_before = zeropp.full_state_dict(model2), gen2.get_state()
    with pytest.raises(CheckpointError, match="extra 'sched': .* this LambdaLR .*lr_lambdas"):
        zeropp.load_checkpoint(tmp_path / "ck", model2, opt2, gen=gen2, sched=sched2)
    after = zeropp.full_state_dict(model2)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not opt2.state and torch.equal(gen2.get_state(), gen_before)


def test_json_extras_keep_their_int_dict_keys_and_multisteplr_its_milestones(tmp_path):
    """JSON's keys are strings: {1: 2.5} came back as {"1": 2.5}, and a MultiStepLR's
    milestones (a Counter of ints) as strings that its epoch never equals."""
    model = _model({})
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.5)
    for _ in range(3):
        opt.step()
        sched.step()
    zeropp.save_checkpoint(tmp_path / "ck", model, opt, sched=sched, best={1: 2.5, 2: 2.25},
                           mixed={"a": {0: None}, 3: [4]})
    opt2 = torch.optim.SGD(model.parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.MultiStepLR(opt2, milestones=[9])
    extra = zeropp.load_checkpoint(tmp_path / "ck", model, opt2, sched=sched2)
    assert extra["best"] == {1: 2.5, 2: 2.25} and extra["mixed"] == {"a": {0: None}, 3: [4]}
    sched.step()
    sched2.step()  # epoch 4, a milestone: 0.5 -> 0.25
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.25
    with pytest.raises(CheckpointError, match="extra 'bad': a dict cannot be saved as JSON"):
        zeropp.save_checkpoint(tmp_path / "ck2", model, bad={(1, 2): 3})


def test_optimizer_state_saved_for_part_of_a_flat_is_refused_not_dropped(tmp_path):
    """Saved with the Linear weights frozen (BitFit: Adam state for the biases alone), loaded
    with everything trainable: one flat now holds weights without state beside biases with it,
    and one step count per flat cannot be part fresh. Before: all its state silently dropped."""
    def sharded(frozen: bool):
        gc.collect()  # as in _model
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        for layer in net:
            layer.weight.requires_grad_(not frozen)
        model = zeropp.shard(net)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = sharded(True)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    zeropp.save_checkpoint(tmp_path / "ck", model, opt)
    model2, opt2 = sharded(False)
    with pytest.raises(CheckpointError, match=r"none for 0\.weight, 1\.weight: load without "
                                              "the optimizer"):
        zeropp.load_checkpoint(tmp_path / "ck", model2, opt2)
    assert not opt2.state
    zeropp.load_checkpoint(tmp_path / "ck", model2)  # the weights alone load


def test_a_save_replaces_a_checkpoint_or_an_empty_directory_never_the_users_files(tmp_path):
    """A save renames what is at its path away and deletes it: before, the user's own
    directory (logs, another run) went too."""
    model, opt = _single(tmp_path)
    zeropp.save_checkpoint(tmp_path / "ck", model, opt)  # a checkpoint: replaced
    (tmp_path / "empty").mkdir()
    zeropp.save_checkpoint(tmp_path / "empty", model, opt)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "train.log").write_text("mine")
    (tmp_path / "ck" / "notes.txt").write_text("mine")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "rank00000.safetensors").write_text("no manifest: not a save's")
    for name, holds in [("logs", "train.log"), ("ck", "notes.txt"), ("out", "rank00000")]:
        with pytest.raises(CheckpointError, match=f"not a zeropp checkpoint .*holds {holds}"):
            zeropp.save_checkpoint(tmp_path / name, model, opt)
    assert (tmp_path / "logs" / "train.log").read_text() == "mine"
    assert (tmp_path / "ck" / "notes.txt").exists() and (tmp_path / "ck" / "manifest.json").exists()


def test_export_writes_one_safetensors_the_unsharded_model_loads(tmp_path):
    from safetensors.torch import load_file

    from zeropp.cli.main import main
    model, _ = _single(tmp_path, GPT_ZEROPP | {"hpz_partition_size": 1})
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "out")]) == 0
    plain = build("gpt")
    plain.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"))  # strict
    x = torch.randint(0, 64, (2, 16))
    model.eval(), plain.eval()
    with torch.no_grad():
        ref = zeropp.shard(build("gpt"))  # the same weights without qwZ's rounding
        zeropp.load_checkpoint(tmp_path / "ck", ref)
        assert torch.allclose(plain(x)[0], ref(x)[0], atol=1e-6, rtol=0)


def test_a_unit_of_0_elements_consolidates_like_full_state_dict(tmp_path):
    """A unit whose one parameter has 0 elements (Linear(4, 0)): `consolidate` (zeropp export,
    zero_to_fp32) gives full_state_dict's 3 tensors (before: "torch.cat(): expected a
    non-empty list of Tensors")."""
    layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 0)])  # 2 units
    model = zeropp.shard(torch.nn.ModuleDict({"layers": layers}))
    zeropp.save_checkpoint(tmp_path / "ck", model)
    full, got = zeropp.full_state_dict(model), consolidate(tmp_path / "ck")
    assert got.keys() == full.keys() and all(torch.equal(got[k], full[k]) for k in full)
    assert len(full) == 4 and got["layers.1.weight"].shape == (0, 4)


def test_a_checkpoint_from_before_a_config_field_existed_keeps_its_engine_state():
    """A field the saved config lacks counts as its default (the saving run had no other
    choice), so upgrading zeropp does not drop qWD copies and error-feedback residuals
    on resume; any real difference still does."""
    from zeropp.checkpoint import config_changes
    cfg = zeropp.Config.preset("zeropp-plus", node_size=2)
    saved = cfg.to_dict()
    del saved["model_persistence_threshold"]  # a checkpoint from before the field
    assert config_changes(saved, cfg) == {}
    assert config_changes(saved, cfg.replace(model_persistence_threshold=10)) == \
        {"model_persistence_threshold": (None, 10)}
    assert config_changes(None, cfg)


def test_only_fields_that_change_the_numbers_are_a_config_change():
    """Prefetching, the reduce pipeline's shape, the timeout and where the node size was
    read keep a checkpoint's qWD copies and residuals; bits, block size and any technique
    do not."""
    from zeropp.checkpoint import config_changes
    cfg = zeropp.Config.preset("zeropp-plus", node_size=2)
    saved = cfg.to_dict()
    assert config_changes(saved, cfg.replace(prefetch=False, node_size=None, **RESCHEDULED)) == {}
    for field, value in [("gradient_error_feedback", False), ("hierarchical_gather", False),
                         ("grad_bits", 8), ("intra_node_grad_bits", 4), ("block_size", 1024),
                         ("persistence_threshold", 100), ("param_dtype", torch.bfloat16)]:
        assert list(config_changes(saved, cfg.replace(**{field: value}))) == [field]


def test_a_checkpoint_saved_with_a_retired_switch_on_is_not_this_config():
    """A field zeropp no longer has counts at the value zeropp now behaves as: INT3
    moves or exact qWD copies saved engine state of another form."""
    from zeropp.checkpoint import config_changes
    cfg = zeropp.Config.preset("zeropp-plus", node_size=2)
    saved = cfg.to_dict()
    assert not config_changes(dict(saved, weight_delta_bits=4, weight_copy_bits=8), cfg)
    assert config_changes(dict(saved, weight_delta_bits=3), cfg) == {"weight_delta_bits": (3, 4)}
    assert config_changes(dict(saved, weight_copy_bits=None), cfg)
