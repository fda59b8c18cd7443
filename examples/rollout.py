"""RLHF-style rollouts with zeropp: a sharded HF causal LM alternates generation
(under `zeropp.gathered`: one gather per rollout, no collective per token) with
a policy-gradient update on a toy reward (the share of generated tokens equal
to a target token). The mean reward rises from chance (1/vocab) towards 1.

    python examples/rollout.py                       # 4 ranks as 2 nodes x 2, zeropp
    python examples/rollout.py --preset zeropp-plus --iters 60 --plot reward.png
    torchrun --nproc-per-node 4 examples/rollout.py  # (LOCAL_WORLD_SIZE ranks per node)

Prints one line per iteration (mean reward over every rank's samples, bytes
this rank sent to generate and to train) and writes them as JSON lines to
`--out` if given.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zeropp
from zeropp.config import named

TARGET = 7  # the token the reward asks for


def build(vocab: int, seed: int):
    import transformers as tf
    torch.manual_seed(seed)
    cfg = tf.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    return tf.GPT2LMHeadModel(cfg)


def sent(model) -> int:
    s = zeropp.comm_stats(model)
    return s["inter_node_bytes"] + s["intra_node_bytes"]


def worker(a: argparse.Namespace) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    node_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    model = zeropp.shard(build(a.vocab, a.seed), named(a.preset, node_size))
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    log = []
    for it in range(a.iters):
        g = torch.Generator().manual_seed(a.seed * 100_003 + it * world + rank)
        prompts = torch.randint(0, a.vocab - 1, (a.batch, 4), generator=g)
        torch.manual_seed(a.seed * 100_003 + it * world + rank)  # generate()'s sampling
        zeropp.reset_comm_stats(model)
        t0 = time.perf_counter()
        with zeropp.gathered(model), torch.no_grad():  # rollout: weights gathered once
            seqs = model.generate(prompts, attention_mask=torch.ones_like(prompts),
                                  do_sample=True, top_k=0, max_new_tokens=a.new_tokens,
                                  min_new_tokens=a.new_tokens, pad_token_id=a.vocab - 1)
        gen_s, gen_bytes = time.perf_counter() - t0, sent(model)
        new = seqs[:, prompts.shape[1]:]
        reward = (new == TARGET).float().mean(dim=1)            # one per sample
        total = torch.stack([reward.sum(), torch.tensor(float(reward.numel()))])
        dist.all_reduce(total)
        mean_reward = (total[0] / total[1]).item()
        # REINFORCE with the global mean reward as the baseline.
        logits = model(input_ids=seqs).logits[:, prompts.shape[1] - 1:-1]
        logp = torch.gather(F.log_softmax(logits.float(), -1), 2, new.unsqueeze(-1)).squeeze(-1)
        loss = -((reward - mean_reward) * logp.sum(dim=1)).mean()
        loss.backward()
        zeropp.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        row = {"iter": it, "mean_reward": mean_reward, "generate_s": gen_s,
               "generate_bytes": gen_bytes, "train_bytes": sent(model) - gen_bytes}
        log.append(row)
        if rank == 0:
            print(f"iter {it:3d}  mean reward {mean_reward:.3f}  generate {gen_s:.2f}s "
                  f"{gen_bytes / 1e3:.0f} kB  train {row['train_bytes'] / 1e3:.0f} kB", flush=True)
    return log


def plot(log: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["iter"] for r in log], [r["mean_reward"] for r in log], marker=".")
    ax.set_xlabel("iteration (generate under zeropp.gathered, then one update)")
    ax.set_ylabel("mean reward")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="zeropp", help="zeropp preset (zero3, zeropp, ...)")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--node-size", type=int, default=2)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--batch", type=int, default=8, help="rollouts per rank per iteration")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the per-iteration log here (JSON lines)")
    p.add_argument("--plot", help="write the reward curve here (PNG)")
    a = p.parse_args(argv)
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        log = worker(a)
    else:
        from zeropp.cli.launch import spawn
        log = spawn(worker, a.nproc, a.node_size, args=(a,), timeout=1800)[0]
    if int(os.environ.get("RANK", "0")) == 0:
        if a.out:
            with open(a.out, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in log)
        if a.plot:
            plot(log, a.plot, f"examples/rollout.py: {a.preset}, {a.nproc} ranks as "
                              f"{a.nproc // a.node_size}x{a.node_size}, {a.batch} rollouts/rank")
    return log


if __name__ == "__main__":
    main()
