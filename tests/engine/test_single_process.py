"""World size 1 (no process group at all) and bad calls to shard()."""

from __future__ import annotations

import copy
import gc
import io
import pickle

import pytest
import torch
from cases import FrozenMLP
from torch import nn

import zeropp
from zeropp.train.model import GPT, GPTConfig


def _train_both(ref: nn.Module, steps: int = 3):
    model = zeropp.shard(copy.deepcopy(ref))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 8), generator=g)
        for m, opt in zip((ref, model), opts):
            m(x, x)[1].backward()
            opt.step()
            opt.zero_grad()
    return model


def test_world_size_1_without_process_group_is_bit_exact():
    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_embd=16, n_head=2))
    model = _train_both(ref)
    sd = zeropp.full_state_dict(model)
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k


def test_a_dead_model_leaves_no_optimizer_step_hook_behind():
    """shard() hooks every optimizer's step (buffer.py); its callbacks go when the model does,
    with everything they would keep alive (hpZ secondaries, qWD copies), also when a collection
    inside another model's step frees it (torch's hook dict was mutated during its iteration)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from zeropp.buffer import _STEPS
    model = _train_both(GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_embd=16,
                                      n_head=2)), steps=1)
    gc.collect()  # earlier tests' models
    with_model = len(_STEPS)
    del model
    gc.collect()
    assert len(_STEPS) == with_model - 1
    dying = zeropp.shard(nn.Linear(4, 4))
    dying.cycle = [dying]  # freed by the cyclic collector only
    del dying
    live = zeropp.shard(nn.Linear(4, 4))
    opt = torch.optim.SGD(live.parameters(), lr=0.1)
    hook = register_optimizer_step_pre_hook(lambda *a: gc.collect() and None)
    try:
        opt.step()  # "OrderedDict mutated during iteration" before
    finally:
        hook.remove()
    assert len(_STEPS) == with_model


def test_tied_embedding_is_stored_once_and_listed_under_both_names():
    torch.manual_seed(0)
    model = zeropp.shard(GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_embd=16,
                                       n_head=2)))
    sd = zeropp.full_state_dict(model)
    assert torch.equal(sd["wte.weight"], sd["lm_head.weight"])
    root_numel = sum(f.numel for f in model._zeropp_state.units[0].flats)
    assert root_numel == 64 * 16 + 8 * 16 + 2 * 16  # wte once, wpe, ln_f


def test_parameters_are_one_master_shard_per_unit_in_fp32():
    model = zeropp.shard(FrozenMLP().to(torch.bfloat16))
    params = list(model.parameters())
    assert all(p.dtype == torch.float32 for p in params)
    # layers.0, layers.1 (frozen), layers.2 split into a trainable and a frozen flat
    assert [p.requires_grad for p in params] == [True, False, True, False]


def test_frozen_parameters_get_no_gradient():
    model = zeropp.shard(FrozenMLP())
    model(torch.randn(3, 12)).sum().backward()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in frozen)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_model_without_parameters_works():
    model = zeropp.shard(nn.Sequential(nn.ReLU(), nn.Tanh()))
    x = torch.randn(4, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None and list(model.parameters()) == []


class _WithEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.empty = nn.Parameter(torch.zeros(3, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.empty.sum()


def test_zero_element_parameter_works():
    torch.manual_seed(0)
    ref = _WithEmpty()
    model = zeropp.shard(copy.deepcopy(ref))
    x = torch.randn(2, 4)
    ref(x).sum().backward()
    model(x).sum().backward()
    sd = zeropp.full_state_dict(model)
    assert sd["empty"].shape == (3, 0)
    expected = torch.cat([ref.lin.weight.grad.flatten(), ref.lin.bias.grad])
    assert torch.equal(model._zeropp_flat0.grad[:15], expected)


def test_shard_twice_raises_clear_error():
    model = zeropp.shard(FrozenMLP())
    with pytest.raises(RuntimeError, match="already sharded"):
        zeropp.shard(model)
    with pytest.raises(RuntimeError, match="already sharded"):
        zeropp.shard(model.layers[0])


def test_shard_rejects_a_non_config():
    with pytest.raises(TypeError, match="zeropp.Config"):
        zeropp.shard(FrozenMLP(), {"quantized_weights": True})


def test_comm_stats_on_unsharded_model_raises():
    with pytest.raises(ValueError, match="not sharded"):
        zeropp.comm_stats(nn.Linear(2, 2))


def test_mixed_precision_bf16_computes_in_bf16_and_keeps_fp32_masters():
    torch.manual_seed(0)
    model = zeropp.shard(FrozenMLP(), zeropp.Config(param_dtype=torch.bfloat16))
    out = model(torch.randn(3, 12))  # fp32 input is cast to bf16 at each unit
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.requires_grad)


def test_no_grad_eval_forward_between_steps_changes_nothing():
    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_embd=16, n_head=2))
    model = zeropp.shard(copy.deepcopy(ref))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model)]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randint(0, 64, (2, 8), generator=g)
        for m, opt in zip((ref, model), opts):
            m(x, x)[1].backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            assert torch.equal(model(x, x)[1], ref(x, x)[1])
    assert all(f.full.untyped_storage().size() == 0 for f in model._zeropp_state.flats)


def test_unit_types_choose_the_units():
    from zeropp.train.model import Block
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_embd=16, n_head=2)

    def gpt():
        torch.manual_seed(0)
        return GPT(cfg)
    auto = zeropp.shard(gpt())
    by_type = zeropp.shard(gpt(), unit_types=(Block,))
    linears = zeropp.shard(gpt(), unit_types=nn.Linear)
    names = [[u.name for u in m._zeropp_state.units] for m in (auto, by_type, linears)]
    assert names[0] == names[1] == ["", "h.0", "h.1"]
    # lm_head's weight is tied to the embedding (the root's), so that unit holds nothing
    assert names[2] == ["", "h.0.attn.qkv", "h.0.attn.proj", "h.0.mlp.fc", "h.0.mlp.proj",
                        "h.1.attn.qkv", "h.1.attn.proj", "h.1.mlp.fc", "h.1.mlp.proj",
                        "lm_head"]
    x = torch.randint(0, 64, (2, 8))
    losses = [m(x, x)[1] for m in (auto, by_type, linears)]
    assert losses[0] == losses[1] == losses[2]


def test_in_backward_is_true_only_while_autograd_runs_a_backward_on_this_thread():
    """unit_hooks._in_backward rests on torch's private `_current_graph_task_id` (-1
    outside a backward): a forward under a backward's checkpoint recompute must be told
    from a user's forward. Pinned here so a torch upgrade that changes it fails loudly."""
    from zeropp.unit_hooks import _in_backward
    seen = []
    x = torch.ones(3, requires_grad=True)
    y = (x * 2).sum()
    assert not _in_backward()
    x.register_hook(lambda g: seen.append(_in_backward()))
    y.backward()
    assert seen == [True] and not _in_backward()


@pytest.mark.parametrize("max_norm", [-1.0, 0.0, float("nan")])
def test_clip_grad_norm_refuses_a_max_norm_that_would_flip_or_zero_the_gradients(max_norm):
    model = zeropp.shard(FrozenMLP())
    with pytest.raises(ValueError, match=f"max_norm must be > 0 .*, got {max_norm}"):
        zeropp.clip_grad_norm_(model, max_norm)


class _Branch(nn.Module):
    """A block whose first layer a forward may skip (a branch unused in some steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x, use_a: bool):
        return torch.tanh(self.b(torch.tanh(self.a(x)) if use_a else x))


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Branch() for _ in range(2))

    def forward(self, x, use_a: bool):
        for blk in self.blocks:
            x = blk(x, use_a)
        return x.sum()


def test_a_parameter_unused_in_one_backward_and_used_in_the_next_trains_as_unsharded():
    """After a backward without `a`, the unit learns to expect fewer gradients; the next
    backward that uses `a` must not free the unit's weights before `a`'s gradient (it did:
    'setStorage ... out of bounds for storage of size 0'). Bit for bit the unsharded run."""
    torch.manual_seed(0)
    ref = _Branchy()
    _trains_as_unsharded(ref, zeropp.shard(copy.deepcopy(ref)),
                         lambda m: torch.optim.SGD(m.parameters(), lr=0.1), [False, True, True])


def _trains_as_unsharded(ref: nn.Module, model: nn.Module, make_opt, uses: list) -> None:
    """`ref` and its sharded copy `model` side by side, `_Branchy`'s branch used in each step
    as `uses` says: every weight after them bit for bit the unsharded run's."""
    opts = [make_opt(m) for m in (ref, model)]
    for step, use_a in enumerate(uses):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        for m, opt in zip((ref, model), opts):
            m(x, use_a).backward()
            opt.step()
            opt.zero_grad()
    sd = zeropp.full_state_dict(model)
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())


@pytest.mark.parametrize("kind", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_gradient_hook_registered_before_shard_is_refused_by_name(kind):
    """shard() replaces the parameters: a hook on one (a gradient clamp) was dropped silently,
    and the unclamped gradient trained the model."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    getattr(model[1].bias, kind)(lambda t: None)
    with pytest.raises(ValueError, match=r"1\.bias has a gradient hook"):
        zeropp.shard(model)


@pytest.mark.parametrize("kind", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_gradient_hook_on_a_master_shard_is_refused_and_one_on_the_attribute_runs(kind):
    """model.parameters() are the master shards, which autograd never reaches: their hooks never
    ran, so an optimizer stepped in backward (torch's tutorial pattern) silently never stepped.
    A hook on the module's attribute sees this rank's full gradient, as under DDP."""
    torch.manual_seed(0)
    model = zeropp.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    master = next(model.parameters())
    opt = torch.optim.SGD([master], lr=0.1)
    handle = getattr(master, kind)(lambda t: opt.step() if kind.startswith("register_post")
                                   else None)
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"hook on a master shard .*holds 0\.weight\) never runs"):
        model(x).sum().backward()
    handle.remove()
    seen = []
    model[0].weight.register_hook(lambda g: seen.append(g.shape) or g * 0)
    model(x).sum().backward()
    assert seen == [torch.Size([4, 4])] and master.grad[:16].abs().sum() == 0


def test_a_branch_unused_in_some_steps_trains_as_unsharded_under_adamw_as_a_unit_of_its_own():
    """Unused in a step, a parameter inside a used unit gets zeros, not None, and AdamW's decay
    and moments moved it (0.012 off after 3 steps; design.md). As a unit of its own (here every
    Linear) a skipped branch gets no gradient at all: bit for bit the unsharded run."""
    torch.manual_seed(0)
    ref = _Branchy()
    _trains_as_unsharded(ref, zeropp.shard(copy.deepcopy(ref), unit_types=(nn.Linear,)),
                         lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1),
                         [True, False, False])


def test_param_groups_given_as_torch_dicts_split_the_flats_as_lists_do():
    """HF's decay / no-decay split as torch writes groups, {"params": [...], ...}: iterating a
    dict gave its keys, so every flat silently fell in no group (-1) and all got the decay."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    decay = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    zeropp.shard(model, param_groups=[{"params": decay}, {"params": rest, "weight_decay": 0.0}])
    flats = model._zeropp_state.flats
    assert sorted(f.param_group for f in flats) == [0, 1]
    assert [f.numel for f in flats if f.param_group == 0] == [16 + 8]


def test_a_sparse_embedding_trains_as_unsharded():
    """nn.Embedding(sparse=True) hands autograd a sparse gradient; copying it into the flat
    gradient failed ("copy_() between dense and sparse Tensors is not implemented"). Within
    1e-6: torch's SGD adds a sparse gradient row by row, the flat one densely."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    model = zeropp.shard(copy.deepcopy(ref))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    for idx in ([[1, 2, 1]], [[3, 1, 9]]):
        for m, opt in zip((ref, model), opts):
            m(torch.tensor(idx)).sum().backward()
            opt.step()
            opt.zero_grad()
    sd = zeropp.full_state_dict(model)
    assert all(torch.allclose(sd[k], v, rtol=0, atol=1e-6) for k, v in ref.state_dict().items())


def test_an_optimizer_step_between_a_forward_and_its_backward_is_refused_as_torch_refuses_it():
    """torch's in-place check fails that backward ("modified by an inplace operation"; a GAN's
    generator loss computed before the critic's step); zeropp gathered the stepped weights for
    it and returned the gradient of other weights than the forward's, silently."""
    torch.manual_seed(0)
    model = zeropp.shard(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    loss = model(torch.randn(3, 4)).sum()
    opt.step()
    with pytest.raises(RuntimeError, match=r"<root>'s weights changed between its forward and "):
        loss.backward()
    model(torch.randn(3, 4)).sum().backward()  # a forward after the step trains on
    opt.step()


def test_a_freeze_through_model_parameters_holds_and_other_requires_grad_changes_are_refused():
    """`unit.requires_grad_(False)` after shard() (a GAN's critic while the generator
    trains): no gradient and no step for it, the rest trains; unfrozen, it trains again. It
    trained on, silently, before. Unfreezing a unit frozen at shard() (no route, no optimizer
    state) or changing one parameter's own flag is refused by name."""
    torch.manual_seed(0)
    model = zeropp.shard(_Branchy())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    critic = list(model.blocks[1].parameters())
    before = [p.detach().clone() for p in critic]
    x = torch.randn(4, 16)
    model.blocks[1].requires_grad_(False)
    model(x, True).backward()
    opt.step()
    assert all(p.grad is None for p in critic)
    assert all(torch.equal(p, b) for p, b in zip(critic, before))
    assert next(model.blocks[0].parameters()).grad is not None
    model.blocks[1].requires_grad_(True)
    opt.zero_grad()
    model(x, True).backward()
    assert all(p.grad is not None for p in critic)
    with torch.no_grad():  # no recorded forward: nothing to check
        model.blocks[0].a.weight.requires_grad_(False)
        model(x, True)
    with pytest.raises(RuntimeError, match=r"requires_grad of parameter blocks\.0\.a\.weight "
                                           r"changed after zeropp.shard\(\)"):
        model(x, True)
    frozen = _Branchy()
    frozen.blocks[1].requires_grad_(False)
    frozen = zeropp.shard(frozen)
    frozen.blocks[1].requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"requires_grad of blocks\.1\._zeropp_flat0 \(with blocks\.1\.a\."):
        frozen(x, True)


@pytest.mark.parametrize("name", ["Adafactor", "LBFGS"])
def test_an_optimizer_that_reads_whole_parameters_is_refused_at_its_first_step(name):
    """Adafactor (factored second moment, per-parameter RMS) and LBFGS (dot products over the
    model) see a flat shard, not the parameters: they silently trained to other numbers
    (Adafactor 8e-3 relative loss after 4 steps at W=1; LBFGS 0.4 at W=2). Elementwise
    optimizers over the same shards still step."""
    model = zeropp.shard(_Branchy())
    opt = getattr(torch.optim, name)(model.parameters(), lr=0.01)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    before = [p.detach().clone() for p in model.parameters()]

    def closure():
        opt.zero_grad()
        loss = model(torch.randn(4, 16, generator=torch.Generator().manual_seed(0)), True)
        loss.backward()
        return loss
    closure()
    with pytest.raises(TypeError, match=f"zeropp: {name} reads whole parameters"):
        opt.step(closure)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    sgd.step()
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_copying_or_pickling_a_sharded_model_is_refused_by_name_and_a_copy_made_before_works():
    """copy.deepcopy of a sharded model (AveragedModel's EMA) failed deep inside `copy` with
    "cannot pickle '_thread.lock' object", and torch.save(model) with pickle's "Can't pickle
    <function Unit.post_forward>" (a hook, met first). Both refused naming the ways that work:
    copy before shard(), shard both (that EMA computes bit for bit the unsharded one's
    outputs); save the state dict, which pickles."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    sharded = zeropp.shard(_Branchy())
    for copying in (lambda: copy.deepcopy(sharded), lambda: AveragedModel(sharded),
                    lambda: copy.deepcopy(sharded.blocks[0]),
                    lambda: torch.save(sharded, io.BytesIO()), lambda: pickle.dumps(sharded),
                    lambda: torch.save(sharded.blocks[0], io.BytesIO())):
        with pytest.raises(TypeError, match=r"cannot be copied or pickled .* copy it before "
                                            r"zeropp.shard.* save zeropp.full_state_dict"):
            copying()
    buf = io.BytesIO()
    torch.save(sharded.state_dict(), buf)
    buf.seek(0)
    assert torch.load(buf).keys() == sharded.state_dict().keys()
    torch.manual_seed(0)
    ref = _Branchy()
    model = copy.deepcopy(ref)
    emas = [AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9)) for m in (ref, model)]
    zeropp.shard(model)
    zeropp.shard(emas[1].module)
    for m, ema in zip((ref, model), emas):
        opt = torch.optim.AdamW(m.parameters(), lr=0.01)
        for step in range(3):
            m(torch.randn(4, 16, generator=torch.Generator().manual_seed(step)), True).backward()
            opt.step()
            opt.zero_grad()
            ema.update_parameters(m)
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(emas[0](x, True), emas[1](x, True))
