"""The main job under torchrun, for one machine or many:

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 \\
        -m zeropp.train --steps 1000 --out runs/big     # same options as `zeropp train`

torchrun numbers ranks node-major and sets LOCAL_WORLD_SIZE, which becomes the
node size. NCCL when CUDA is available, gloo otherwise. `--compare` is for the
single-machine launcher (`zeropp train`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..cli.commands import make_dir
from ..cli.main import (
    CACHE,
    UsageError,
    _config_json,
    add_train_args,
    configs_from,
    resume_own_run,
    train_args_from,
)
from .data import DataError
from .loop import prepare_tokens, train_worker
from .report import plot, summarize, table
from .resume import candidates
from .tokenizer import TokenizerError


def main() -> int:
    p = argparse.ArgumentParser(prog="torchrun ... -m zeropp.train")
    add_train_args(p)
    ns = p.parse_args()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ns.nproc, ns.node_size = world, int(os.environ.get("LOCAL_WORLD_SIZE", world))
    try:
        if ns.compare:
            raise UsageError("--compare runs under `zeropp train` on one machine, not torchrun")
        a = train_args_from(ns)
        (_, cfg), = configs_from(ns)
        run_dir = Path(ns.out or f"runs/torchrun-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
        if not a.resume and candidates(run_dir):  # as `zeropp train` does (it started over)
            said = resume_own_run(a, run_dir, cfg, keep=True)  # (every rank: none renames)
            if rank == 0:
                print(f"zeropp.train: {said}", file=sys.stderr, flush=True)
        # each machine's first rank prepares its own copy (no shared filesystem assumed)
        tokens_file = run_dir / f"tokens-node{rank // ns.node_size}.pt"
        vocab, error = None, None
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            try:
                make_dir(run_dir, "--out")
                ids, vocab = prepare_tokens(a, CACHE)
                torch.save(ids.to(torch.int32), tokens_file)
                if rank == 0:
                    (run_dir / "config.json").write_text(_config_json(a, cfg, ns))
            except (UsageError, DataError, TokenizerError) as e:
                error = str(e)
        # Every rank learns of any node's error (each then exits 2, rank 0 saying why),
        # where the others died in a broadcast with a traceback each (connection reset).
        # It is also the barrier after each node's tokens file is written.
        found: list = [None] * world
        dist.all_gather_object(found, (vocab, error))
        errors = [e for _, e in found if e]
        if errors:
            raise UsageError(errors[0])
        out = train_worker(a, cfg, str(run_dir), str(tokens_file), found[0][0])
    except (UsageError, DataError, TokenizerError) as e:
        if rank == 0:
            print(f"zeropp.train: {e}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    dist.barrier()
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        tokens_file.unlink(missing_ok=True)
    if rank == 0:
        row = summarize("run", out)
        (run_dir / "summary.json").write_text(json.dumps(row, indent=2))  # as zeropp train's
        drew = plot({"run": out["history"]}, run_dir / "loss.png", f"zeropp: {world} ranks")
        print("\n" + table([row]) + f"\n\nFiles in {run_dir}/: config.json, metrics.jsonl, "
              "summary.json, checkpoints/" + (", loss plot loss.png" if drew else
                                              " (no plot: matplotlib is not installed)"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
