"""The training loop each worker runs: plain PyTorch around zeropp.shard."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeropp

from ..bench.plan import volumes
from ..checkpoint_files import CheckpointError, read_manifest
from ..cli.launch import at_step, no_restart
from . import resume as ckpts
from .data import get_batch, load_text, split_tokens
from .model import GPT, PRESETS, GPTConfig
from .tokenizer import encode


@dataclass
class TrainArgs:
    steps: int = 300
    batch: int = 4            # sequences per rank per micro-batch
    seq_len: int = 128
    accum: int = 1            # micro-batches per step
    model: str = "gpt-6x256"
    hf_model: Optional[str] = None   # "gpt2" | "llama": built from a config, offline
    tokenizer: str = "bytes"
    lr: float = 2e-3
    warmup: int = 50          # linear warm-up steps; with 30 the demo's loss spikes at step 8
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    data: Optional[str] = None
    eval_every: int = 50
    eval_batches: int = 8
    log_every: int = 10
    save_every: int = 100     # steps between checkpoints (0: only at the end)
    keep_checkpoints: int = 2
    resume: Optional[str] = None     # a checkpoint or run directory


def lr_at(step: int, a: TrainArgs) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio` of the peak."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def prepare_tokens(a: TrainArgs, cache_dir: Path) -> tuple[torch.Tensor, int]:
    """Token ids of the corpus (validated: errors are DataError/TokenizerError)."""
    ids, vocab = encode(load_text(a.data), a.tokenizer, cache_dir)
    split_tokens(ids, a.seq_len)  # too short fails here, before any worker starts
    return ids, vocab


class HFCausalLM(nn.Module):
    """A transformers causal LM behind the same (idx, targets) -> (logits, loss) call."""

    def __init__(self, kind: str, vocab: int, a: TrainArgs) -> None:
        super().__init__()
        try:
            import transformers as tf
        except ImportError:
            raise ValueError("--hf-model needs transformers (pip install 'zeropp[hf]')") from None
        p = PRESETS[a.model]
        if kind == "gpt2":
            self.hf = tf.GPT2LMHeadModel(tf.GPT2Config(
                vocab_size=vocab, n_positions=a.seq_len, n_embd=p["n_embd"],
                n_layer=p["n_layer"], n_head=p["n_head"]))
        elif kind == "llama":
            self.hf = tf.LlamaForCausalLM(tf.LlamaConfig(
                vocab_size=vocab, hidden_size=p["n_embd"], intermediate_size=4 * p["n_embd"],
                num_hidden_layers=p["n_layer"], num_attention_heads=p["n_head"],
                max_position_embeddings=a.seq_len))
        else:
            raise ValueError(f"unknown --hf-model {kind!r}; choose gpt2 or llama")

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        logits = self.hf(input_ids=idx).logits
        loss = None if targets is None else F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss


def build_model(a: TrainArgs, vocab: int) -> nn.Module:
    if a.model not in PRESETS:
        raise ValueError(f"unknown model preset {a.model!r}; choose one of "
                         f"{', '.join(PRESETS)}")
    torch.manual_seed(a.seed)  # the same initial weights on every rank
    if a.hf_model:
        return HFCausalLM(a.hf_model, vocab, a)
    return GPT(GPTConfig(vocab_size=vocab, block_size=a.seq_len, **PRESETS[a.model]))


@torch.no_grad()
def _val_loss(model, val, a: TrainArgs, rank: int, world: int) -> float:
    gen = torch.Generator().manual_seed(10_000 + rank)  # the same batches every eval (CPU RNG)
    was = model.training
    model.eval()  # no dropout (--hf-model gpt2 has 0.1: val loss read 0.0125 high at step 2)
    try:
        losses = [model(*get_batch(val, a.batch, a.seq_len, gen))[1].item()
                  for _ in range(a.eval_batches)]
    finally:
        model.train(was)
    t = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64, device=val.device)
    dist.all_reduce(t)
    return t.item() / world


class _Progress:
    """A live bar on a terminal (tqdm), a plain line every `every` steps otherwise."""

    def __init__(self, total: int, every: int, enabled: bool) -> None:
        self.every, self.enabled, self.bar = every, enabled, None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True, unit="step")

    def update(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif step % self.every == 0:
            print(f"step {step:5d} | {text}", flush=True)

    def note(self, text: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _json_lines(f: Path) -> list[dict]:
    """The rows of a JSONL file; a line cut short by a crash is dropped."""
    rows = []
    for line in (f.read_text().splitlines() if f.exists() else []):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def rewrite_metrics(f: Path, before: int) -> list[dict]:
    """Keep the rows of steps before `before`, each once (the last written) and in
    order, replacing the file atomically: a kill during the rewrite leaves the
    old file, never a cut one. Returns the rows kept."""
    rows = {r["step"]: r for r in _json_lines(f) if isinstance(r.get("step"), int)
            and r["step"] < before}
    kept = [rows[s] for s in sorted(rows)]
    tmp = f.with_name(f".{f.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, f)
    return kept


def _resume(a: TrainArgs, cfg: zeropp.Config, out: Path, model: nn.Module,
            opt: torch.optim.Optimizer, gen: torch.Generator, rank: int
            ) -> tuple[int, int, list]:
    """Where this run starts: step 0, or the checkpoint of `--resume` (chosen and
    verified by the launcher), or (a worker the launcher restarted after a crash)
    the run's newest checkpoint that loads, a damaged newer one named and set
    aside (resume.py). Returns (start step, steps skipped so far, metrics rows
    before it). An unreadable checkpoint or a change of settings is raised as
    `no_restart`: a restart would only meet it again."""
    tries: list[Path] = []
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        tries = ckpts.candidates(out)  # restarted after a crash: this run's own
    if not tries and a.resume:
        tries = [Path(a.resume)]
    history: list = []
    extra, ck = None, None
    same_world = True
    for i, ck in enumerate(tries):
        try:
            # Each rank's data stream is per rank: at another world size it cannot be
            # continued, so it is reseeded from the step (weights and optimizer reshard).
            same_world = read_manifest(ck)["world_size"] == dist.get_world_size()
            extra = zeropp.load_checkpoint(ck, model, opt,
                                           **({"data_gen": gen} if same_world else {}))
            break
        except CheckpointError as e:  # raised on every rank alike (guards.agree)
            if i == len(tries) - 1:
                raise no_restart(e) from None
            if rank == 0:  # every rank listed `tries` before the load's collective check
                moved = ckpts.set_aside(ck).name
                print(f"zeropp train: skipping damaged checkpoint {ck.name} ({e}); kept "
                      f"as {moved}", file=sys.stderr, flush=True)
    if extra is None:
        if rank == 0:
            rewrite_metrics(out / "metrics.jsonl", 0)
        return 0, 0, history
    try:
        ckpts.check_same_run(extra["train_args"], dataclasses.asdict(a), ck)
        ckpts.check_same_config(read_manifest(ck), cfg, ck)
        ckpts.resumed_at(out, ck)  # a restart before this run's first save comes back to ck
    except CheckpointError as e:
        raise no_restart(e) from None
    start = extra["step"]
    if not same_world:
        gen.manual_seed(a.seed * 1000 + rank + 7919 * start)
    for g in opt.param_groups:  # this run's flags win (lr follows lr_at every step)
        g["weight_decay"] = a.weight_decay
    if rank == 0:  # keep the metrics up to the checkpoint; later rows are replayed
        history = rewrite_metrics(out / "metrics.jsonl", start)
        print(f"resumed from {ck} at step {start}", flush=True)
    return start, extra["skipped"], history


def train_worker(a: TrainArgs, cfg: zeropp.Config, run_dir: str, tokens_file: str,
                 vocab: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(run_dir)
    # NCCL means one GPU per rank; gloo trains on the CPU
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    ids = torch.load(tokens_file, weights_only=True).long().to(device)
    train_ids, val_ids = split_tokens(ids, a.seq_len)
    model = build_model(a, vocab).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes = (cfg.param_dtype or next(model.parameters()).dtype).itemsize
    zeropp.shard(model, cfg)
    topo = model._zeropp_state.topo
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay,
                            betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(a.seed * 1000 + rank)  # each rank its own rows
    # ZeRO-3's bytes per node per step across nodes (`zeropp plan`'s model): forward
    # and backward gathers at the compute width, one fp32 reduce-scatter, each once
    # per micro-batch (measured zero3 at --accum 2: 2.000x the one-micro-batch value)
    zero3 = a.accum * volumes(n_params, world, topo.num_nodes, param_bytes, 4, 2048,
                              False, False, False)["cross"]
    tokens_per_step = a.batch * a.seq_len * a.accum * world
    start, skipped, history = _resume(a, cfg, out, model, opt, gen, rank)
    metrics = open(out / "metrics.jsonl", "a") if rank == 0 else None  # noqa: SIM115
    bar = _Progress(a.steps, a.log_every, rank == 0)
    val, carry = None, 0.0
    try:
        for step in range(start, a.steps):
            at_step(step)
            t0 = time.perf_counter()
            lr = lr_at(step, a)
            for g in opt.param_groups:
                g["lr"] = lr
            zeropp.reset_comm_stats(model)
            loss_sum = 0.0
            for _ in range(a.accum):
                x, y = get_batch(train_ids, a.batch, a.seq_len, gen)
                _, loss = model(x, y)
                (loss / a.accum).backward()
                loss_sum += loss.item() / a.accum
            norm = float(zeropp.clip_grad_norm_(model, a.clip))
            ok = math.isfinite(norm)
            if ok:
                opt.step()
            else:  # a NaN/Inf gradient on any rank: every rank skips this step
                skipped += 1
            opt.zero_grad()
            dt = time.perf_counter() - t0
            # one small all-reduce: the mean loss and each node's bytes this step
            s = zeropp.comm_stats(model)
            v = torch.zeros(1 + 2 * topo.num_nodes, dtype=torch.float64, device=device)
            v[0] = loss_sum / world
            v[1 + topo.node], carry = s["inter_node_bytes"] + carry, 0.0
            v[1 + topo.num_nodes + topo.node] = s["intra_node_bytes"]
            dist.all_reduce(v)
            inter = v[1:1 + topo.num_nodes].max().item()
            intra = v[1 + topo.num_nodes:].max().item()
            row = {"step": step, "train_loss": v[0].item(), "lr": lr, "grad_norm": norm,
                   "step_time": dt, "tokens_per_s": tokens_per_step / dt,
                   "inter_node_bytes": inter, "intra_node_bytes": intra, "skipped": not ok}
            if (step + 1) % a.eval_every == 0 or step == a.steps - 1:
                val = row["val_loss"] = _val_loss(model, val_ids, a, rank, world)
                if 1 < cfg.hpz_partition_size <= topo.node_size:
                    # With hpZ inside the node the evaluation's first forward after a step
                    # refreshes the secondaries (a world gather, or qWD's deltas), which
                    # the next step then does not send; its later forwards gather inside
                    # the node. So every inter-node byte it sent is the next step's.
                    carry = zeropp.comm_stats(model)["inter_node_bytes"] - s["inter_node_bytes"]
            history.append(row)
            if metrics is not None:
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
            bar.update(step, f"loss {row['train_loss']:.3f}"
                       + (f" val {val:.3f}" if val is not None else "")
                       + f" | {row['tokens_per_s']:,.0f} tok/s | inter-node "
                       f"{inter / 1e6:.2f} MB/step" + (" | SKIPPED (non-finite)" if not ok
                                                      else ""))
            if not ok:
                bar.note(f"step {step}: non-finite gradient norm; step skipped")
            if (a.save_every and (step + 1) % a.save_every == 0) or step == a.steps - 1:
                name = f"step_{step + 1:06d}"
                zeropp.save_checkpoint(ckpts.checkpoint_dir(out) / name, model, opt,
                                       step=step + 1, skipped=skipped, data_gen=gen,
                                       train_args=dataclasses.asdict(a))
                ckpts.after_save(out, name, a.keep_checkpoints)
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()
    return {"history": history, "n_params": n_params, "zero3_inter_node_bytes": zero3,
            "skipped": skipped, "world": world, "nodes": topo.num_nodes, "start_step": start}
