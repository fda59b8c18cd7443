"""zeropp.fsdp2.install under N-D parallelism, W=4 as 2 nodes x 2, AdamW, fp32, gloo:
- tensor parallel x FSDP as torchtitan orders it (TP inside the node first: the MLPs'
  up projection ColwiseParallel, the down one RowwiseParallel; then `fully_shard` per
  block and on the root over the mesh's "dp" dimension), TP=2, so each FSDP group has
  one rank per node and all of FSDP's traffic crosses nodes;
- HSDP: `fully_shard` on a (replicate 2, shard 2) mesh, shard inside the node, where
  stock FSDP2 all-reduces every gradient across nodes at full width;
- expert parallel as torchtitan shards it: each block's experts are a DTensor over the
  "ep" mesh (inside the node), and one `fully_shard` per block puts them on the
  "efsdp" mesh (one rank per node) and the rest on all 4 ranks (`shard_placement_fn`),
  so the block holds two FSDP parameter groups, which FSDP2's public custom-comm
  setters refuse (comms.py's note).

- TP x FSDP again at W=8 as 2 nodes x 4 (dp groups of 4 ranks, 2 per node: hpZ, the
  hierarchical gather and qWD run there), every preset.

The TP model is `cases.TPLM` (and, under `dp_mesh_dims` on a ("tp", "dp") mesh, two
`cases.TPBlock`s): norms, `down`'s bias, the embedding and the head are
left whole by TP, and each TP rank's dp group trains its own copy of them, which
must stay bitwise equal (fsdp2/regions.py's note). One spawned world per size runs
stock FSDP2 and the presets on the same model and data; the tests check its results.
(At W=4 with one dp rank per node, and with HSDP's shard group inside the node, hpZ
has nothing to do: zeropp-plus and stock carry the loss checks there.)"""

from __future__ import annotations

import hashlib
import warnings

import pytest
import torch
import torch.distributed as dist
from cases import (
    TPLM,
    TPBlock,
    assert_loss_drop,
    assert_same_losses,
    dcp_resume,
    fit,
    random_batches,
    replicated_digest,
    tp_fsdp,
)
from torch import nn

from zeropp.cli.launch import spawn
from zeropp.train.model import GPT, GPTConfig

STEPS = 12  # the TP and HSDP runs (zeropp-plus at 0.997 of stock's loss drop by 12)
EP_STEPS = 20  # the expert-parallel runs (0.97-0.985 of stock's by 12, 0.982-0.988 by 20)
EP_ZERO3_STEPS = 8  # expert-parallel zero3 against stock's first 8 (exact to 1e-5 at each)
HOOKED = 8  # steps of the HSDP run with a user's hook (its losses against the first 8)


def _tp_lm(dp: int = 2):
    torch.manual_seed(0)
    return tp_fsdp(TPLM(), dp)


def _fit(model, preset, data_rank: int, probe: bool = True, steps: int = STEPS,
         replicated: bool = False, then=None) -> dict:
    """`preset` installed (None: stock FSDP2), `steps` of AdamW on random batches seeded
    by `data_rank`: each step's loss (the ranks' mean), the digest of the TP-replicated
    parameters' shards (if asked), the probe's output (the logits' bytes) on a fixed
    batch afterwards (unless not asked: the root's weights stay gathered after it), the
    byte accounting, and what install warned. `then(model)` runs after install."""
    import zeropp.fsdp2
    caught = []
    if preset is not None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            zeropp.fsdp2.install(model, preset, node_size=dist.get_world_size() // 2)
    if then is not None:
        then(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    own = fit(model, opt, random_batches(steps, 256, (2, 32), data_rank))
    losses = torch.tensor(own)
    dist.all_reduce(losses)
    out = {"own": own, "losses": (losses.double() / dist.get_world_size()).tolist(),
           "warnings": [str(w.message) for w in caught],
           "stats": zeropp.comm_stats(model) if preset is not None else None}
    if replicated:
        out["replicated"] = replicated_digest(model)
    if probe:
        with torch.no_grad():
            x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(99))
            out["probe"] = model(x, x)[0].numpy().tobytes()
    return out


def _train(preset, dp: int = 2, steps: int = STEPS):
    model, mesh = _tp_lm(dp)
    # the two TP ranks of a dp rank see the same batch
    return _fit(model, preset, mesh["dp"].get_local_rank(), steps=steps, replicated=True)


def _hsdp_gpt(split: bool = False):
    """HSDP; with `split`, each block's MLP goes on the 1-D mesh of all 4 ranks beside
    the rest on the HSDP mesh (two parameter groups), through a `shard_placement_fn`
    that hands every block the same two mesh infos, as torchtitan's MoE sharding does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        HSDPMeshInfo,
        ShardPlacementResult,
    )
    from torch.distributed.tensor import Shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hsdp = HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    flat = FSDPMeshInfo(init_device_mesh("cpu", (4,)), shard_mesh_dim=0) if split else None
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=3, n_embd=64, n_head=2))
    for block in model.h:
        mlp = set(block.mlp.parameters())
        fully_shard(block, mesh=mesh, shard_placement_fn=(lambda p, mlp=mlp: ShardPlacementResult(
            Shard(0), flat if p in mlp else hsdp)) if split else None)
    fully_shard(model, mesh=mesh)
    return model


def _train_hsdp(preset, hooks: bool = False, steps: int = STEPS, split: bool = False):
    """HSDP; with `hooks`, every module gets an all-reduce hook of the user's that only
    records a digest and the L2 norm of what it sees: the first block's set before
    install, the others' after it, as torchtitan's fault-tolerant HSDP sets them. Under
    zeropp every module but the first also gets a gradient divide factor of 4 (every
    rank: the mean again), the second block's before install, the others' after."""
    from zeropp.stats import ring_send
    model, seen, l2 = _hsdp_gpt(split), [], []

    def hook(grad: torch.Tensor) -> None:
        seen.append(hashlib.sha256(grad.numpy().tobytes()).hexdigest())
        l2.append(grad.norm().item())

    def set_later(model) -> None:
        for m in [*model.h[1:], model]:
            m.set_all_reduce_hook(hook)
            if preset is not None and m is not model.h[1]:
                m.set_gradient_divide_factor(4.0)
    if hooks:
        model.h[0].set_all_reduce_hook(hook)
        if preset is not None:  # (stock would reduce with PREMUL_SUM, which gloo lacks)
            model.h[1].set_gradient_divide_factor(4.0)
    out = _fit(model, preset, dist.get_rank(), probe=False, steps=steps,
               then=set_later if hooks else None)
    local = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()
                       if p.device_mesh.ndim == 2])  # (the HSDP mesh's)
    # stock HSDP's all-reduce: a ring over the 2 replicas of each module's fp32
    # reduce-scatter output (this rank's shard), every step, all of it across nodes
    shard_bytes = 4 * sum(fp.padded_sharded_param_size.numel()
                          for m in model.modules() if hasattr(m, "_get_fsdp_state")
                          for g in m._get_fsdp_state()._fsdp_param_groups
                          for fp in g.fsdp_params)
    return {**out, "local": local.numpy().tobytes(), "seen": seen, "l2": l2,
            "stock_allreduce_bytes": ring_send(shard_bytes, 2, 2) * steps}


class _LocalExperts(nn.Module):
    """An MoE MLP with this ep rank's experts: a softmax router mixes them per token.
    No token dispatch (what is under test is FSDP's traffic): each ep rank's experts
    learn from the tokens of the data-parallel ranks at its ep index."""

    def __init__(self, width: int, experts: int, ep) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor
        super().__init__()
        w = torch.randn(experts, width, width) * width ** -0.5
        self.w = nn.Parameter(distribute_tensor(w, ep, [Shard(0)]))
        self.router = nn.Linear(width, experts // ep.size())

    def forward(self, x):
        gate = self.router(x).softmax(-1)
        return torch.einsum("bte,btd,edf->btf", gate, x, self.w.to_local())


def _ep_gpt():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )
    from torch.distributed.tensor import Shard
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_embd=64, n_head=2))
    dense, experts = FSDPMeshInfo(world, shard_mesh_dim=0), FSDPMeshInfo(mesh["efsdp"],
                                                                         shard_mesh_dim=0)
    for block in model.h:
        block.mlp = _LocalExperts(64, 8, mesh["ep"])
        fully_shard(block, mesh=world, shard_placement_fn=lambda p, w=block.mlp.w:
                    ShardPlacementResult(Shard(0), experts if p is w else dense))
    fully_shard(model, mesh=world)
    return model


def _train_ep(preset, steps: int = EP_STEPS):
    model = _ep_gpt()
    out = _fit(model, preset, dist.get_rank(), steps=steps)
    return {**out, "groups": [len(b._get_fsdp_state()._fsdp_param_groups) for b in model.h]}


def _train_spmd(hsdp: bool = False, steps: int = 3) -> dict:
    """`fully_shard(dp_mesh_dims=...)`: every parameter a DTensor on one 2-D mesh, the
    second dim inside the node. TP x FSDP on ("tp", "dp") (TP's dim first, `up` and `down`
    TP-sharded), or with `hsdp` HSDP on ("shard", "rep") (the replicas across nodes), two
    `TPBlock`s, zeropp-plus, `steps` of AdamW on a regression. The digest of this rank's
    shards (TP: of the parameters TP leaves whole), and the ops comm_stats counted."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import zeropp.fsdp2
    names = ("shard", "rep") if hsdp else ("tp", "dp")
    mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2).T, mesh_dim_names=names)
    dims = DataParallelMeshDims(shard="shard", replicate="rep") if hsdp else \
        DataParallelMeshDims(shard="dp")
    tp = {} if hsdp else {"up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1)}
    torch.manual_seed(0)
    model = nn.Sequential(TPBlock(16), TPBlock(16))
    for block in model:
        for name, p in list(block.named_parameters()):
            owner, attr = name.rsplit(".", 1)
            getattr(block, owner).register_parameter(attr, nn.Parameter(distribute_tensor(
                p.detach(), mesh, [tp.get(name, Replicate()), Replicate()])))
        fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (TP: hpZ off, one dp rank per node)
        zeropp.fsdp2.install(model, "zeropp-plus", node_size=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    g = torch.Generator().manual_seed(dist.get_rank() if hsdp else mesh["dp"].get_local_rank())
    batch = [Shard(0), Shard(0)] if hsdp else [Replicate(), Shard(0)]  # each dp rank's rows
    for _ in range(steps):
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
        out = model(DTensor.from_local(x, mesh, batch)).redistribute(mesh, batch).to_local()
        torch.nn.functional.mse_loss(out, y).backward()
        opt.step()
        opt.zero_grad()
    digest = hashlib.sha256(b"".join(p.to_local().detach().contiguous().numpy().tobytes()
                                     for _, p in sorted(model.named_parameters()))).hexdigest() \
        if hsdp else replicated_digest(model, fsdp_dim=1)
    return {"digest": digest, "ops": sorted(zeropp.comm_stats(model)["by_op"])}


PRESETS = ["zero3", "qwz", "hpz", "qgz", "zeropp", "zeropp-plus"]
# (dp 2 x tp 2: each dp group has one rank per node, where "hpz" is exactly "zero3")
TP_PRESETS = [p for p in PRESETS if p != "hpz"]


def _work(ckpt: str) -> dict:
    torch.set_num_threads(1)
    out = {p or "stock": _train(p) for p in (None, "zero3", "zeropp-plus")}
    out.update({p: _train(p, steps=8) for p in TP_PRESETS if p not in out})
    out.update({f"hsdp-{p or 'stock'}": _train_hsdp(p, hooks=p is None)
                for p in (None, "zero3", "zeropp-plus")})
    out["hsdp-hooked"] = _train_hsdp("zeropp-plus", hooks=True, steps=HOOKED)
    out["hsdp-split"] = _train_hsdp("zeropp-plus", steps=3, split=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # hpZ off on the TP and expert meshes: tested above
        out.update({f"ep-{p or 'stock'}": _train_ep(p) for p in (None, "zeropp-plus")})
        out["ep-zero3"] = _train_ep("zero3", steps=EP_ZERO3_STEPS)
        out["spmd"] = _train_spmd()
        out["spmd-hsdp"] = _train_spmd(hsdp=True)
        out["resume-tp"] = dcp_resume(lambda: _tp_lm()[0], dist.get_rank() // 2, f"{ckpt}/tp")
    out["resume-hsdp"] = dcp_resume(_hsdp_gpt, dist.get_rank(), f"{ckpt}/hsdp")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return spawn(_work, 4, 2, args=(str(tmp_path_factory.mktemp("nd")),), timeout=300)


def test_tp_x_fsdp_zero3_preset_gives_stock_losses_to_1e5_relative(runs):
    assert_same_losses(runs[0]["zero3"]["losses"], runs[0]["stock"]["losses"])


def test_tp_x_fsdp_zeropp_plus_sends_at_most_0_25x_zero3s_cross_node_bytes(runs):
    inter = {p: sum(r[p]["stats"]["inter_node_bytes"] for r in runs)
             for p in ("zero3", "zeropp-plus")}
    # every byte of the dp group's traffic crosses nodes: zero3's is all of FSDP2's
    assert sum(r["zero3"]["stats"]["intra_node_bytes"] for r in runs) == 0 < inter["zero3"]
    assert 0 < inter["zeropp-plus"] <= 0.25 * inter["zero3"], inter


@pytest.mark.parametrize("preset", ["stock", *TP_PRESETS])
def test_tp_x_fsdp_every_rank_computes_the_same_outputs_bit_for_bit(runs, preset):
    assert len({r[preset]["probe"] for r in runs}) == 1


@pytest.mark.parametrize("preset", ["stock", *TP_PRESETS])
def test_tp_replicated_parameters_stay_bitwise_equal_on_every_tp_rank(runs, preset):
    """The norms, `down`'s bias, the embedding and the head: each TP rank's dp group
    trains its own copy (regions.py's note); rank = 2 x dp + tp."""
    for a, b in ((0, 1), (2, 3)):
        assert runs[a][preset]["replicated"] == runs[b][preset]["replicated"]


def test_tp_replicated_parameters_stay_bitwise_equal_under_dp_mesh_dims_with_tp_first(runs):
    """regions.py: under `fully_shard(dp_mesh_dims=...)` FSDP's dims are those it names,
    wherever they are in the mesh; taken as the leading ones, on a ("tp", "dp") mesh every
    parameter counted as one kind, the block was one region, and the norms' copies parted
    (4e-4 to 7.9e-3 apart in 4 steps)."""
    assert [r["spmd"]["digest"] for r in runs[::2]] == [r["spmd"]["digest"] for r in runs[1::2]]


def test_hsdp_under_dp_mesh_dims_keeps_the_replicas_bitwise_identical_with_zeropps_mean(runs):
    """HSDP named by dp_mesh_dims on a ("shard", "rep") mesh (the replicas' dim second):
    zeropp's mean over the replicas runs in place of FSDP2's all-reduce, which sends
    nothing (no `all_reduce/fsdp2/replicas` counted), and the replicas stay identical."""
    for a, b in ((0, 2), (1, 3)):  # rank = 2 x replica + shard
        assert runs[a]["spmd-hsdp"]["digest"] == runs[b]["spmd-hsdp"]["digest"]
    for r in runs:
        ops = r["spmd-hsdp"]["ops"]
        assert "all_reduce/fsdp2/replicas" not in ops, ops
        assert "reduce_scatter/hsdp_grad/inter" in ops, ops


def test_tp_x_fsdp_zeropp_plus_reaches_98pct_of_stocks_loss_drop(runs):
    assert_loss_drop(runs[0]["zeropp-plus"]["losses"], runs[0]["stock"]["losses"])


def test_one_rank_per_node_says_hpz_is_off_in_one_warning_on_rank_0(runs):
    said = runs[0]["zeropp-plus"]["warnings"]
    assert len(said) == 1 and "one rank per node" in said[0] and "hpZ cannot" in said[0], said
    assert runs[1]["zeropp-plus"]["warnings"] == [] and runs[0]["zero3"]["warnings"] == []


def test_hsdp_zero3_preset_gives_stock_hsdp_losses_to_1e5_relative(runs):
    assert_same_losses(runs[0]["hsdp-zero3"]["losses"], runs[0]["hsdp-stock"]["losses"])


def test_hsdp_zeropp_plus_sends_at_most_0_20x_of_stock_hsdps_all_reduce_across_nodes(runs):
    ours = sum(r["hsdp-zeropp-plus"]["stats"]["inter_node_bytes"] for r in runs)
    stock = sum(r["hsdp-stock"]["stock_allreduce_bytes"] for r in runs)
    assert 0 < ours <= 0.20 * stock, (ours, stock, ours / stock)


def test_hsdp_zero3_preset_counts_fsdp2s_all_reduce_as_all_its_cross_node_bytes(runs):
    """Without qgZ the all-reduce over the replicas is FSDP2's own; comm_stats counts it
    (the shard group is inside the node: it is every byte that crosses)."""
    for r in runs:
        assert r["hsdp-zero3"]["stats"]["inter_node_bytes"] == r["hsdp-zero3"][
            "stock_allreduce_bytes"] > 0


@pytest.mark.parametrize("preset", ["stock", "zero3", "zeropp-plus"])
def test_hsdp_replicas_stay_bitwise_identical(runs, preset):
    for a, b in ((0, 2), (1, 3)):  # (replicate, shard) mesh: rank = 2 * replica + shard
        assert runs[a][f"hsdp-{preset}"]["local"] == runs[b][f"hsdp-{preset}"]["local"]


def test_hsdp_replicas_stay_bitwise_identical_with_two_groups_per_block_on_shared_mesh_infos(
        runs):
    """replicate.py's note: each group's all-reduce is taken over in its own copy of
    the mesh info; taken over in the shared one, every block after the first found no
    replicas in it and reduced over none (its replicas parted from the first step)."""
    for a, b in ((0, 2), (1, 3)):
        assert runs[a]["hsdp-split"]["local"] == runs[b]["hsdp-split"]["local"]


def test_a_users_all_reduce_hook_on_hsdp_runs_on_zeropps_replica_mean(runs):
    """Set before install or after (replicate.py's note): it sees the mean, the same
    bits on both replicas, on every module at every step, and the mean is kept: the
    same losses as without the hook (and the divide factors), replicas bitwise equal."""
    for a, b in ((0, 2), (1, 3)):
        assert runs[a]["hsdp-hooked"]["seen"] == runs[b]["hsdp-hooked"]["seen"]
        assert runs[a]["hsdp-hooked"]["local"] == runs[b]["hsdp-hooked"]["local"]
    for r in runs:
        assert len(r["hsdp-hooked"]["seen"]) == 4 * HOOKED  # 3 blocks and the root
        assert r["hsdp-hooked"]["own"] == r["hsdp-zeropp-plus"]["own"][:HOOKED]


def test_a_users_all_reduce_hook_on_hsdp_sees_stocks_mean_to_5pct_in_norm_at_the_first_step(
        runs):
    """What stock FSDP2's hook sees, the mean over every rank (qgZ's INT4 off it by 3% at
    most here; a sum left undivided is 2x or 4x): FSDP2's division comes before the
    hook, by the module's gradient divide factor where one is set (the sum / 4)."""
    for r in runs:
        ours, stock = r["hsdp-hooked"]["l2"][:4], r["hsdp-stock"]["l2"][:4]
        assert all(abs(a / b - 1) < 0.05 for a, b in zip(ours, stock)), (ours, stock)


def test_hsdp_zeropp_plus_reaches_98pct_of_stock_hsdps_loss_drop(runs):
    assert_loss_drop(runs[0]["hsdp-zeropp-plus"]["losses"], runs[0]["hsdp-stock"]["losses"])


def test_expert_parallel_blocks_hold_two_fsdp_groups_and_zero3_gives_stocks_losses(runs):
    assert runs[0]["ep-zero3"]["groups"] == [2, 2]
    for r in runs:  # each rank's own losses: the ep ranks train different experts
        assert_same_losses(r["ep-zero3"]["own"], r["ep-stock"]["own"][:EP_ZERO3_STEPS])


def test_expert_parallel_zeropp_plus_sends_at_most_0_25x_zero3s_cross_node_bytes(runs):
    inter = {p: sum(r[f"ep-{p}"]["stats"]["inter_node_bytes"] / r[f"ep-{p}"]["stats"]["steps"]
                    for r in runs) for p in ("zero3", "zeropp-plus")}  # a step's mean
    assert 0 < inter["zeropp-plus"] <= 0.25 * inter["zero3"], inter


def test_expert_parallel_zeropp_plus_reaches_98pct_of_stocks_loss_drop_on_every_rank(runs):
    for r in runs:
        assert_loss_drop(r["ep-zeropp-plus"]["own"], r["ep-stock"]["own"])
    for p in ("stock", "zero3", "zeropp-plus"):  # the same experts: the same probe
        for ep in (0, 1):  # rank = 2 x efsdp + ep
            assert len({r[f"ep-{p}"]["probe"] for r in runs[ep::2]}) == 1, p


# (each technique alone is checked on the TP mesh above; here the three together, with
# hpZ's secondaries, the hierarchical gather and qWD running)
W8_PRESETS = ["zero3", "zeropp", "zeropp-plus"]


def _work8() -> dict:
    torch.set_num_threads(1)
    return {p: _train(p, dp=4, steps=6) for p in W8_PRESETS}


@pytest.fixture(scope="module")
def runs8():
    """W=8 as 2 nodes x 4, TP 2 inside the node: dp groups of 4 ranks, 2 per node, so
    hpZ, the hierarchical gather and qWD run on them."""
    return spawn(_work8, 8, 4, timeout=300)


@pytest.mark.parametrize("preset", W8_PRESETS)
def test_w8_tp_replicated_parameters_and_every_ranks_outputs_stay_bitwise_equal(runs8, preset):
    for a in range(0, 8, 2):
        assert runs8[a][preset]["replicated"] == runs8[a + 1][preset]["replicated"]
    assert len({r[preset]["probe"] for r in runs8}) == 1


def test_w8_tp_zeropp_sends_at_most_0_15x_and_zeropp_plus_0_09x_zero3s_cross_node_bytes(runs8):
    inter = {p: sum(r[p]["stats"]["inter_node_bytes"] for r in runs8)
             for p in ("zero3", "zeropp", "zeropp-plus")}
    assert 0 < inter["zeropp"] <= 0.15 * inter["zero3"], inter
    assert 0 < inter["zeropp-plus"] <= 0.09 * inter["zero3"], inter


@pytest.mark.parametrize("mesh", ["tp", "hsdp"])
def test_resume_through_dcp_and_comm_state_gives_the_uninterrupted_losses_bit_for_bit(
        runs, mesh):
    for r in runs:
        assert r[f"resume-{mesh}"]["resumed"] == r[f"resume-{mesh}"]["whole"], r[f"resume-{mesh}"]


def test_fsdp2s_hsdp_internals_are_the_ones_zeropp_takes_over():
    """replicate.py's note: FSDP2 all-reduces over mesh_info.replicate_process_group. A
    torch whose FSDP2 no longer does fails here, and install refuses HSDP there."""
    from types import SimpleNamespace

    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from zeropp.fsdp2.replicate import check_internals
    group = FSDPParamGroup.__new__(FSDPParamGroup)  # the class FSDP2 runs, no state
    group.mesh_info = SimpleNamespace(replicate_process_group=None)
    check_internals(group)


def test_fsdp2s_custom_comm_setters_write_the_group_slots_zeropp_sets_per_group():
    """comms.py's note: with several parameter groups zeropp writes the slots FSDP2's
    setters write. A torch whose setters write other attributes fails here."""
    from zeropp.fsdp2.comms import check_setter
    for setter, attr in (("set_custom_all_gather", "_all_gather_comm"),
                         ("set_custom_reduce_scatter", "_reduce_scatter_comm"),
                         ("set_all_reduce_hook", "_all_reduce_hook")):
        check_setter(setter, attr)
    with pytest.raises(NotImplementedError, match="set_custom_all_gather.*_reduce_scatter"):
        check_setter("set_custom_all_gather", "_reduce_scatter_comm")


def test_fsdp_dims_named_as_a_tuple_count_as_fsdps_own_in_the_kinds():
    """fully_shard(dp_mesh_dims=DataParallelMeshDims(shard=("a", "b"))) flattens the two
    dims into one, "a_b" in the sharded DTensor's mesh: FSDP's own, not a kind (it read
    'a_b:S(0)', a region per FSDP placement). Measured on 8 ranks, ("a", "b", "tp") and
    HSDP x TP on 16: zero3 = stock, TP copies and replicas bitwise equal before and after."""
    from types import SimpleNamespace as NS

    from torch.distributed.tensor import Replicate, Shard

    from zeropp.fsdp2.regions import Kinds

    class Group:  # what Kinds reads of an FSDPParamGroup (weakly: a class of its own)
        mesh_info = NS(mesh=NS(ndim=1, mesh_dim_names=("a_b",)),
                       dp_mesh_dims=NS(shard_names=("a", "b"), replicate_names=()))
        fsdp_params = [NS(sharded_param=NS(device_mesh=NS(mesh_dim_names=("a_b", "tp")),
                                           placements=(fsdp, tp), requires_grad=True),
                          padded_sharded_param_size=torch.Size([4]))
                       for fsdp, tp in ((Shard(0), Replicate()), (Shard(1), Replicate()),
                                        (Shard(0), Shard(0)))]
    kinds = Kinds(Group(), "block")
    assert kinds.kinds == ["", "", "tp:S(0)"]
    assert [r.kind for r in kinds.regions(12)] == ["", "tp:S(0)"]


def test_a_chunk_short_of_an_unused_parameter_warns_naming_fsdp2s_remedy():
    """regions.py's note: a chunk of neither every parameter nor the trainable ones
    travels as one region, and the warning names set_reduce_scatter_unused_params."""
    from types import SimpleNamespace as NS

    from torch.distributed.tensor import Replicate, Shard

    from zeropp.fsdp2.regions import Kinds

    class Group:  # what Kinds reads of an FSDPParamGroup (weakly: a class of its own)
        mesh_info = NS(mesh=NS(ndim=1))
        fsdp_params = [NS(sharded_param=NS(device_mesh=NS(mesh_dim_names=("dp", "tp")),
                                           placements=(Shard(0), tp), requires_grad=True),
                          padded_sharded_param_size=torch.Size([n]))
                       for tp, n in ((Shard(0), 4), (Replicate(), 2), (Replicate(), 2))]
    group = Group()
    kinds = Kinds(group, "block")
    assert [r.kind for r in kinds.regions(8, grads=True)] == ["", "tp:S(0)"]
    with pytest.warns(UserWarning, match=r"set_reduce_scatter_unused_params\(True\) keeps"):
        assert [r.kind for r in kinds.regions(6, grads=True)] == ["*"]
