"""`zeropp train`: the main job (later issues grow it). Also `python -m zeropp`."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import zeropp

from .launch import WorkerError, spawn
from .train.data import DataError, load_tokens
from .train.loop import TrainArgs, train_worker


def _train(ns: argparse.Namespace) -> int:
    if ns.nproc < 1 or ns.node_size < 1 or ns.nproc % ns.node_size:
        print(f"zeropp train: --nproc {ns.nproc} must be a positive multiple of "
              f"--node-size {ns.node_size}", file=sys.stderr)
        return 2
    a = TrainArgs(steps=ns.steps, batch=ns.batch, seq_len=ns.seq_len, n_layer=ns.n_layer,
                  n_embd=ns.n_embd, lr=ns.lr, seed=ns.seed, data=ns.data)
    try:
        load_tokens(a.data, a.seq_len)  # fail here, in one line, not in 4 workers
        cfg = zeropp.Config(node_size=ns.node_size)
    except (DataError, ValueError) as e:
        print(f"zeropp train: {e}", file=sys.stderr)
        return 2
    try:
        out = spawn(train_worker, ns.nproc, ns.node_size, args=(a, cfg), timeout=ns.timeout)
    except WorkerError as e:
        print(f"zeropp train failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("zeropp train: interrupted; workers stopped", file=sys.stderr)
        return 130
    h = out[0]["history"]
    per_step = sum(r["inter_node_bytes"] for r in h) / len(h)
    print(f"done: loss {h[0]['loss']:.3f} -> {h[-1]['loss']:.3f} in {len(h)} steps; "
          f"inter-node {per_step / 1e6:.2f} MB per node per step "
          f"(ZeRO-3 analytic {out[0]['zero3_inter_node_bytes'] / 1e6:.2f} MB)")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="zeropp")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a small GPT on Shakespeare with zeropp")
    d = TrainArgs()
    t.add_argument("--nproc", type=int, default=4, help="ranks on this machine")
    t.add_argument("--node-size", type=int, default=2, help="ranks per (emulated) node")
    t.add_argument("--steps", type=int, default=d.steps)
    t.add_argument("--batch", type=int, default=d.batch, help="sequences per rank per step")
    t.add_argument("--seq-len", type=int, default=d.seq_len)
    t.add_argument("--n-layer", type=int, default=d.n_layer)
    t.add_argument("--n-embd", type=int, default=d.n_embd)
    t.add_argument("--lr", type=float, default=d.lr)
    t.add_argument("--seed", type=int, default=d.seed)
    t.add_argument("--data", default=None, help="a UTF-8 text file (default: Shakespeare)")
    t.add_argument("--timeout", type=float, default=1800, help="seconds before giving up")
    ns = p.parse_args(argv)
    return _train(ns)


if __name__ == "__main__":
    sys.exit(main())
