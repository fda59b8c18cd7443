"""Training-loop patterns beyond forward-backward-step, each against plain
PyTorch on the same model (world size 1 runs every hook; hpZ needs W=2)."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import zeropp
from zeropp.cli.launch import spawn


class Blocks(nn.Module):
    def __init__(self, n: int = 3, frozen: bool = False, ckpt: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))
        self.aux = nn.ModuleList([nn.Linear(8, 2)])  # a head not every loss uses
        self.out = nn.Linear(8, 3)
        self.ckpt = ckpt
        if frozen:
            self.blocks.requires_grad_(False)

    def forward(self, x, use_aux: bool = False):
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=False) if self.ckpt else torch.tanh(b(h))
        self.aux_out = self.aux[0](h)
        return self.out(h)


def _pair(**kw):
    ref = Blocks(**kw)
    return ref, zeropp.shard(copy.deepcopy(ref))


def _grads(model) -> torch.Tensor:
    """The model's gradient as one flat vector (sharded: gathered, W=1)."""
    if hasattr(model, "_zeropp_state"):
        return torch.cat([f.primary_shard.grad[:f.numel] for f in model._zeropp_state.flats
                          if f.primary_shard.grad is not None])
    return None


def _ref_grads(model) -> torch.Tensor:
    """Reference gradient in the engine's flat order (units in module order)."""
    order = [model.inp, model.out, *model.blocks, *model.aux]  # root's params first
    parts = []
    for m in order:
        if m.weight.grad is not None:
            parts += [m.weight.grad.flatten(), m.bias.grad]
    return torch.cat(parts)


X = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
X2 = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))


def test_two_forwards_then_one_backward():
    ref, model = _pair()
    for m in (ref, model):
        (m(X).sum() + m(X2).pow(2).sum()).backward()
    assert torch.allclose(_grads(model), _ref_grads(ref), atol=1e-6)


def test_no_grad_forward_between_forward_and_backward():
    ref, model = _pair()
    for m in (ref, model):
        loss = m(X).sum()
        with torch.no_grad():
            m(X2)
        loss.backward()
    assert torch.allclose(_grads(model), _ref_grads(ref), atol=1e-6)


def test_activation_checkpointing_of_units():
    ref, model = _pair(ckpt=True)
    for m in (ref, model):
        m(X).sum().backward()
    assert torch.allclose(_grads(model), _ref_grads(ref), atol=1e-6)


def test_unit_off_the_loss_path_keeps_grad_none_and_adamw_leaves_it():
    ref, model = _pair()
    aux_before = model.aux[0]._zeropp_flat0.detach().clone()
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5) for m in (ref, model)]
    for m, opt in zip((ref, model), opts):
        m(X).sum().backward()
        opt.step()
    assert ref.aux[0].weight.grad is None and model.aux[0]._zeropp_flat0.grad is None
    assert torch.equal(model.aux[0]._zeropp_flat0.detach(), aux_before)


def test_frozen_unit_used_twice_and_called_with_keywords_is_freed_in_backward():
    class TwiceKw(Blocks):
        def forward(self, x):
            h = torch.tanh(self.inp(x))
            for b in self.blocks:
                h = torch.tanh(b(input=h))   # keyword-only input
                h = torch.tanh(b(input=h))   # the same frozen unit again
            return self.out(h)

    torch.manual_seed(0)
    ref = TwiceKw(frozen=True)
    model = zeropp.shard(copy.deepcopy(ref))
    flats = model._zeropp_state.flats
    most = [0]

    def track(grad):  # called during backward: how many units are gathered now?
        most[0] = max(most[0], sum(f.gathered for f in flats if not f.trainable))
    for m in (ref, model):
        h = m(X)
        if m is model:
            h.register_hook(track)
            for b in model.blocks:
                b.register_full_backward_hook(lambda *a: track(None))
        h.sum().backward()
    assert torch.allclose(_grads(model), _ref_grads(ref), atol=1e-6)
    assert most[0] <= 2  # frozen units are freed as backward leaves them, not at the end


@dataclass
class Out:
    y: torch.Tensor
    note: str = "a dataclass, not a pytree"


def test_unit_returning_a_dataclass():
    class DC(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            return Out(self.lin(x))

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList([DC(), DC()])

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x).y)
            return x

    ref = M()
    model = zeropp.shard(copy.deepcopy(ref))
    for m in (ref, model):
        m(X).sum().backward()
    g = torch.cat([model.layers[i]._zeropp_flat0.grad[:42] for i in range(2)])
    r = torch.cat([torch.cat([ref.layers[i].lin.weight.grad.flatten(), ref.layers[i].lin.bias.grad])
                   for i in range(2)])
    assert torch.allclose(g, r, atol=1e-6)


def test_double_backward_is_a_clear_error():
    _, model = _pair()
    x = X.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(model(x).sum(), x, create_graph=True)


def test_an_exception_in_forward_does_not_leave_stale_weights():
    ref, model = _pair()
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    original = model.blocks[1].forward
    model.blocks[1].forward = lambda x: (_ for _ in ()).throw(ValueError("bad batch"))
    with pytest.raises(ValueError):
        model(X)
    model.blocks[1].forward = original
    for m, opt in zip((ref, model), opts):
        m(X).sum().backward()
        opt.step()
        opt.zero_grad()
    assert torch.allclose(model(X2), ref(X2), atol=1e-6)


def _fused(kw: dict) -> list[float]:
    model = zeropp.shard(Blocks(), zeropp.Config(**kw))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    x = X[dist.get_rank()::2]
    losses = []
    for _ in range(4):
        loss = F.mse_loss(model(x), torch.ones(x.shape[0], 3))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_hpz_refreshes_after_a_fused_optimizer_step():
    """Fused AdamW updates the shards without bumping their version counter;
    hpZ must still serve the new weights after each step."""
    plain = spawn(_fused, 2, 2, args=({},), timeout=60)
    hpz = spawn(_fused, 2, 2, args=({"hpz_partition_size": 2},), timeout=60)
    assert plain == hpz
    assert plain[0][0] != plain[0][-1]


class HeadInRoot(nn.Module):
    """Blocks, then a head the root holds alone (a Llama's lm_head and norm when
    the input embedding is a unit of its own)."""

    def __init__(self, n: int = 3, spare: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(n))
        if spare:
            for b in self.blocks:
                b.spare = nn.Parameter(torch.randn(6))  # a parameter no forward reads
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def _reduction_order(model) -> list[str]:
    """Record the units in the order their gradients reach the reduce pipeline."""
    st, order = model._zeropp_state, []
    submit = st.reducer.submit
    st.reducer.submit = lambda label, *a: (order.append(label), submit(label, *a))[1]
    return order


def test_root_holding_only_the_head_is_reduced_first_not_at_the_end_of_backward():
    """Per-parameter gradient hooks run as soon as a gradient is complete: the
    root's head, done first in backward, is reduced (and its weights freed)
    before the blocks, not held to the end as a split made at the root's
    forward start was (autograd ran it last)."""
    ref = HeadInRoot()
    model = zeropp.shard(copy.deepcopy(ref))
    order = _reduction_order(model)
    for m in (ref, model):
        m(X).sum().backward()
    assert order == ["<root>", "blocks.2", "blocks.1", "blocks.0"]
    got = torch.cat([f.primary_shard.grad[:f.numel] for f in model._zeropp_state.flats])
    want = torch.cat([p.grad.flatten() for m in (ref.head, *ref.blocks) for p in m.parameters()])
    assert torch.equal(got, want)


def test_a_parameter_backward_never_reaches_is_learnt_after_one_step():
    """A unit with a parameter no forward reads: the first backward reduces it at
    its end (zeros for that parameter, exact for the rest); from the second on
    the unit is reduced as soon as the parameters backward does reach arrive."""
    ref = HeadInRoot(spare=True)
    model = zeropp.shard(copy.deepcopy(ref))
    order = _reduction_order(model)
    model(X).sum().backward()
    assert order == ["<root>", "blocks.0", "blocks.1", "blocks.2"]  # end: unit order
    ref(X).sum().backward()
    flats = model._zeropp_state.flats
    for b, f in zip(ref.blocks, flats[1:]):
        assert torch.equal(f.primary_shard.grad[:f.numel],
                           torch.cat([b.weight.grad.flatten(), b.bias.grad, torch.zeros(6)]))
    order.clear()
    model(X).sum().backward()
    assert order == ["<root>", "blocks.2", "blocks.1", "blocks.0"]  # learnt: as they finish


def test_forward_pre_hooks_registered_before_shard_see_the_gathered_weights():
    """A pre-hook the model brought (nn.utils.weight_norm's recomputes `weight` from
    weight_g and weight_v) runs after the unit's gather: it read 0-element tensors,
    and torch's weight norm of those killed the process (SIGFPE). The (8, 8) weight
    the hook sees, and a weight-normed block's gradients, are plain PyTorch's."""
    ref, model = Blocks(), Blocks()
    seen = []
    model.blocks[1].register_forward_pre_hook(lambda m, a: seen.append(m.weight.detach().clone()))
    zeropp.shard(model)(X)
    assert torch.equal(seen[0], ref.blocks[1].weight)
    ref, model = Blocks(), Blocks()
    for m in (ref, model):
        m.blocks[0] = nn.utils.weight_norm(m.blocks[0])
    model = zeropp.shard(model)
    for m in (ref, model):
        m(X).sum().backward()
    got = model.blocks[0]._zeropp_flat0.grad
    want = torch.cat([ref.blocks[0].bias.grad, ref.blocks[0].weight_g.grad.flatten(),
                      ref.blocks[0].weight_v.grad.flatten()])
    assert torch.allclose(got[:want.numel()], want, atol=1e-6)


class Lora(nn.Module):
    """PEFT's LoRA layer: a frozen base weight and a trainable low-rank update beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 8).requires_grad_(False)
        self.down, self.up = nn.Linear(8, 2, bias=False), nn.Linear(2, 8, bias=False)

    def forward(self, h):
        return self.base(h) + self.up(self.down(h))


class LoraBlocks(Blocks):
    """Each block a unit of frozen and trainable weights, called twice per forward,
    each call bare (`reentrant` None) or under activation checkpointing."""

    def __init__(self, reentrant) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Lora() for _ in self.blocks)
        self.reentrant = reentrant

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for b in [b for b in self.blocks for _ in range(2)]:
            h = torch.tanh(b(h) if self.reentrant is None
                           else checkpoint(b, h, use_reentrant=self.reentrant))
        return self.out(h)


@pytest.mark.parametrize("reentrant", [None, False, True])
def test_units_of_frozen_and_trainable_weights_train_as_unsharded(reentrant):
    """The input's gradient needs the frozen base weight after the adapters' gradients
    have arrived: the unit was freed then, and backward failed ("setStorage ... out of
    bounds for storage of size 0"). Two SGD steps: outputs within 1e-6 of PyTorch's."""
    ref = LoraBlocks(reentrant)
    model = zeropp.shard(copy.deepcopy(ref))
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
            for m in (ref, model)]
    for m, opt in zip((ref, model), opts):
        for x in (X, X2):
            loss = m(x).sum()
            with torch.no_grad():
                m(x)  # (an eval forward before the backward)
            loss.backward()
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        assert torch.allclose(model(X), ref(X), atol=1e-6)


def test_a_gathered_context_left_inside_inference_mode_lets_training_go_on():
    """RLHF's rollout: `with torch.inference_mode(), zeropp.gathered(model)`. The buffers
    let go at its exit were made as inference tensors, and the next training forward's
    gather into them failed ("Inplace update to inference tensor outside InferenceMode").
    Two SGD steps around it: outputs within 1e-6 of PyTorch's."""
    ref, model = _pair()
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    for m, opt in zip((ref, model), opts):
        for x in (X, X2):
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
            if m is model:
                with torch.inference_mode(), zeropp.gathered(model):
                    model(X2)
    with torch.no_grad():
        assert torch.allclose(model(X), ref(X), atol=1e-6)


@pytest.mark.parametrize("between", ["no_grad", "gathered"])
def test_an_eval_between_forward_and_backward_leaves_units_of_two_flats_gathered(between):
    """shard(param_groups=...) (the decay / no-decay split HF's Trainer makes) gives each
    unit two flats. A no_grad root forward, or a zeropp.gathered() context, between a
    forward and its backward forgot that the forward's units await gradients: a unit was
    freed when its biases' came, and backward failed ("The size of tensor a (0) must
    match the size of tensor b (8)"). Two SGD steps: outputs within 1e-6 of PyTorch's."""
    ref = Blocks()
    model = copy.deepcopy(ref)
    model = zeropp.shard(model, param_groups=[[p for n, p in model.named_parameters()
                                               if n.endswith("weight")]])
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    for m, opt in zip((ref, model), opts):
        for x in (X, X2):
            loss = m(x).sum()
            ctx = zeropp.gathered(model) if between == "gathered" and m is model else None
            with torch.no_grad(), ctx or contextlib.nullcontext():
                m(X2)
            loss.backward()
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        assert torch.allclose(model(X), ref(X), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64])
def test_a_parameter_of_complex_or_integer_dtype_is_refused_naming_it(dtype):
    """The fp32 master shards would cut it: a complex weight lost its imaginary part (outputs
    0.43 off) with only torch's cast warning."""
    model = nn.Sequential(nn.Linear(4, 4))
    model.register_parameter("odd", nn.Parameter(torch.ones(3, dtype=dtype), requires_grad=False))
    with pytest.raises(TypeError, match=rf"parameter 'odd' is {dtype}; only floating-point"):
        zeropp.shard(model)
    assert model.odd.dtype == dtype and model[0].weight.numel() == 16  # left as it was
