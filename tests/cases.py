"""Models, data and the training loop shared by the tests: the distributed run
(inside spawned workers) and the single-process reference run the same code.
Also the in-process check of the CLI's one-line errors, and what is left of a
launcher's process group."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zeropp.train.model import GPT, GPTConfig

MICRO_BATCH = 2  # rows per rank per micro-batch


class FrozenMLP(nn.Module):
    """Three linear layers; the middle one frozen (a frozen-only unit) and the
    last bias frozen (a unit with trainable and frozen parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(12, 24), nn.Linear(24, 24), nn.Linear(24, 5)])
        self.layers[1].requires_grad_(False)
        self.layers[2].bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def build(name: str) -> nn.Module:
    torch.manual_seed(1234)
    if name == "gpt":
        # No biases: attention's key bias has an exactly zero true gradient
        # (softmax ignores a constant shift), so Adam's normalized step on it
        # follows rounding noise and no two summation orders agree.
        return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32,
                             bias=False))
    if name == "mlp":
        return FrozenMLP()
    raise ValueError(name)


def batch(name: str, step: int, micro: int, world: int, rank: int | None):
    """Micro-batch `micro` of step `step`: the global batch, or rank `rank`'s rows."""
    g = torch.Generator().manual_seed(10_000 * step + micro)
    n = MICRO_BATCH * world
    if name == "gpt":
        x = torch.randint(0, 64, (n, 16), generator=g)
        y = torch.randint(0, 64, (n, 16), generator=g)
    else:
        x = torch.randn(n, 12, generator=g)
        y = torch.randn(n, 5, generator=g)
    if rank is not None:
        x, y = x[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH], y[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH]
    return x, y


def loss_of(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "gpt":
        return model(x, y)[1]
    return F.mse_loss(model(x).float(), y)


def make_opt(opt: str, params) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if opt == "adamw":
        # lr 1e-3: at 1e-2 this random-token task is chaotic under Adam, and even
        # single-process runs differing only in summation order drift apart by
        # 2e-2 in the weights within 20 steps (measured); no parity test can pass.
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.5)


def train(name: str, opt_name: str, model: nn.Module, *, steps: int, accum: int, world: int,
          rank: int | None, clip: float | None, clip_fn) -> tuple[list[float], list[float]]:
    """Returns (this process's loss per step, grad norm per step). With `rank`
    None it trains on the global batch (the reference)."""
    opt = make_opt(opt_name, model.parameters())
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            x, y = batch(name, step, micro, world, rank)
            loss = loss_of(name, model, x, y) / accum
            loss.backward()
            total += loss.item()
        if clip is not None:
            norms.append(float(clip_fn(model, clip)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms


def fit(model: nn.Module, opt: torch.optim.Optimizer, batches, *, loss_fn=None, clip_fn=None,
        each=None) -> list[float]:
    """The tests' one training loop besides `train`: an optimizer step per (x, y) of
    `batches` (loss_fn(model, x, y), default model(x, y)[1]; backward; clip_fn(model,
    1.0) if given; step; zero_grad; `each()` after it). Returns each step's loss."""
    losses = []
    for x, y in batches:
        loss = loss_fn(model, x, y) if loss_fn is not None else model(x, y)[1]
        loss.backward()
        if clip_fn is not None:
            clip_fn(model, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if each is not None:
            each()
    return losses


def assert_same_losses(ours: list[float], ref: list[float], rel: float = 1e-5) -> None:
    """Every step's loss within `rel` of the reference run's (relative)."""
    assert len(ours) == len(ref)
    for s, (a, b) in enumerate(zip(ours, ref)):
        assert abs(a - b) <= rel * abs(b), (s, a, b)


def assert_loss_drop(ours: list[float], ref: list[float], frac: float = 0.98) -> None:
    """The run's loss falls at least `frac` of what the reference run's falls."""
    assert ours[0] - ours[-1] >= frac * (ref[0] - ref[-1]), (ref[-1], ours[-1])


def dcp_resume(build, data_rank: int, ckpt: str) -> dict:
    """FSDP2 with zeropp-plus installed (`build()` makes the fully_shard model): 8 steps
    straight, saved after the 4th (DCP + zeropp.fsdp2.save_comm_state), and that
    checkpoint loaded into a fresh model and optimizer, 4 more; the losses of the last 4
    both ways (so the save also leaves the straight run's bits alone)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import zeropp.fsdp2
    batches = list(random_batches(8, 256, (2, 32), data_rank))

    def fresh():
        model = zeropp.fsdp2.install(build(), "zeropp-plus", node_size=2)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = fresh()
    fit(model, opt, batches[:4])
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    zeropp.fsdp2.save_comm_state(model, ckpt)
    whole = fit(model, opt, batches[4:])
    model, opt = fresh()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    zeropp.fsdp2.load_comm_state(model, ckpt)
    return {"whole": whole, "resumed": fit(model, opt, batches[4:])}


class TPBlock(nn.Module):
    """A LayerNorm, then `up` and `down` (for ColwiseParallel / RowwiseParallel), residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class TPLM(nn.Module):
    """The LM a tensor-parallel user writes: `TPBlock`s (`tp_fsdp` shards their `up` and
    `down`), and an embedding, a final LayerNorm and an untied head that TP leaves whole,
    as it does the norms and `down`'s bias. `forward(x, y)` gives (logits, loss) as
    zeropp's GPT does."""

    def __init__(self, vocab: int = 256, width: int = 64, blocks: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(TPBlock(width) for _ in range(blocks))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        logits = self.head(self.norm(h))
        return logits, F.cross_entropy(logits.flatten(0, 1), y.flatten())


def tp_fsdp(model: TPLM, dp: int, tp: int = 2) -> tuple[nn.Module, Any]:
    """`model` under tensor parallel x FSDP in torchtitan's order on a (dp, tp) mesh, TP
    inside the node: each block's `up` ColwiseParallel, `down` RowwiseParallel, then
    `fully_shard` per block and on the root over "dp". Returns (model, mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(),
                                               "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def replicated_digest(model: nn.Module, fsdp_dim: int = 0) -> str:
    """A digest of this rank's shards of the parameters that tensor parallel leaves
    whole (Replicate on every mesh dim but FSDP's, `fsdp_dim`): the same on every TP rank
    of one data-parallel index while they hold one model. Call it while the model is sharded."""
    import hashlib
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        if all(pl.is_replicate() for i, pl in enumerate(p.placements) if i != fsdp_dim):
            h.update(p.to_local().detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def random_batches(steps: int, vocab: int, shape: tuple, seed: int):
    """`steps` (x, x) pairs of random tokens, from a generator seeded with `seed`."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, vocab, shape, generator=g)
        yield x, x


def task_batch(step: int, world: int, rank: int | None):
    """A learnable task for loss-parity runs: each row counts up from a random
    start with a random stride (1-3) modulo 64; the model must infer the stride."""
    g = torch.Generator().manual_seed(step)
    n = MICRO_BATCH * world
    start = torch.randint(0, 64, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + stride * torch.arange(17)) % 64
    x, y = seq[:, :-1], seq[:, 1:]
    if rank is not None:
        x, y = x[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH], y[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH]
    return x, y


def calm_and_crash(tmp_path, a, cfg, crash_fn, after: str) -> tuple[dict, dict]:
    """The main job's worker at W=4 as 2x2 twice on the same tokens: once
    undisturbed, once through `crash_fn` (train_worker's arguments plus `after`,
    the checkpoint after which it kills a rank) with one launcher restart.
    Returns rank 0's results of both."""
    from zeropp.cli.launch import spawn
    from zeropp.cli.main import CACHE
    from zeropp.train.loop import prepare_tokens, train_worker
    ids, vocab = prepare_tokens(a, CACHE)
    tokens = tmp_path / "tokens.pt"
    torch.save(ids.to(torch.int32), tokens)
    (tmp_path / "calm").mkdir()
    (tmp_path / "crash").mkdir()
    calm = spawn(train_worker, 4, 2, args=(a, cfg, str(tmp_path / "calm"), str(tokens), vocab),
                 timeout=300)[0]
    crash = spawn(crash_fn, 4, 2, timeout=300, max_restarts=1,
                  args=(a, cfg, str(tmp_path / "crash"), str(tokens), vocab, after))[0]
    return calm, crash


def cli_error_line(argv: list[str], capsys) -> str:
    """Run `zeropp argv` in this process (no torch import per case; each CLI test
    file checks the process boundary once) and return its one error line: exit
    status 2, nothing else on stderr, no traceback and no Python warning (stderr
    would show them)."""
    from zeropp.cli.main import main
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = main(argv)
    assert not caught, [str(w.message) for w in caught]
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, err
    assert "Traceback" not in err + out
    return lines[0]


def failed_run(out: str, err: str, keep: int = 3000) -> str:
    """What a failed subprocess left, for an assertion message: its output's tail and,
    where a rank crashed (PYTHONFAULTHANDLER=1), the start of the crash report, whose
    thread stacks the tail would cut off behind the extension-module list."""
    text = out + err
    crash = text.find("Fatal Python error")
    head = f"{text[crash:crash + keep]}\n[...]\n" if 0 <= crash < len(text) - keep else ""
    return head + text[-keep:]


def group_alive(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group: what is left of the world
    of a launcher started with start_new_session=True."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(pid))
    return alive


def kill_session(p: Any, within: float) -> float:
    """SIGKILL the launcher `p` (started with start_new_session=True) and wait up to
    `within` s for every process of its session to go; the seconds that took."""
    p.kill()
    t0 = time.monotonic()
    p.wait(timeout=10)
    while group_alive(p.pid) and time.monotonic() - t0 < within:
        time.sleep(0.05)
    return time.monotonic() - t0
