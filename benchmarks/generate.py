"""Generation bench: RLHF-style rollouts, each after a training step, with
per-token gathers vs the weights gathered once, zeropp vs FSDP2.

Modes (SYSTEM-HOW): SYSTEM is a zeropp preset (zero3, zeropp, zeropp-plus) or
fsdp2; HOW is `pertoken` (every forward gathers, as generate() under plain
sharding does), `gathered` (zeropp.gathered) or `unshard` (FSDP2's
counterpart of summon_full_params: `unshard()` every FSDP module with
`reshard_after_forward` off, `reshard()` after). Each timed rollout follows an
optimizer step, as in RLHF, so hpZ secondaries and caches are stale each time.

4 ranks as 2 nodes x 2: on the emulated cluster (one torchrun per node
namespace) or on loopback (one torchrun).

    python benchmarks/generate.py --links loopback,100mbit [--write]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import report

MODES = ("zeropp-pertoken", "zeropp-gathered", "zero3-pertoken", "zero3-gathered",
         "fsdp2-pertoken", "fsdp2-unshard")


def _build(a):
    import torch
    import transformers as tf
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=a.vocab, n_positions=128, n_embd=a.n_embd, n_layer=a.n_layer, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


@contextlib.contextmanager
def _fsdp_unsharded(model):
    from torch.distributed.fsdp import FSDPModule
    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in mods:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


def _rank(out: str, mode: str, a) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import zeropp
    from zeropp.bench.worker import link_bytes
    from zeropp.config import named
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    system, how = mode.rsplit("-", 1)
    model = _build(a)
    if system == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    else:
        model = zeropp.shard(model, named(system, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    prompts = torch.randint(1, a.vocab, (a.batch, 8), generator=g)

    def train_step() -> None:
        x = torch.randint(1, a.vocab, (2, 33), generator=g)
        logits = model(input_ids=x[:, :-1]).logits
        F.cross_entropy(logits.reshape(-1, a.vocab), x[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()

    def stats() -> tuple[int, int]:
        if system == "fsdp2":
            return 0, 0
        s = zeropp.comm_stats(model)
        return s["inter_node_bytes"], s["intra_node_bytes"]

    ctx = {"gathered": lambda: zeropp.gathered(model), "unshard": lambda: _fsdp_unsharded(model),
           "pertoken": contextlib.nullcontext}[how]
    rows, tokens = [], None
    for r in range(a.rounds + 1):  # round 0 warms up
        train_step()
        dist.barrier()
        c0, s0, t0 = link_bytes(), stats(), time.perf_counter()
        with ctx(), torch.no_grad():
            seqs = model.generate(prompts, attention_mask=torch.ones_like(prompts),
                                  max_new_tokens=a.tokens, min_new_tokens=a.tokens,
                                  do_sample=False, pad_token_id=0)
        dist.barrier()
        t, c1, s1 = time.perf_counter() - t0, link_bytes(), stats()
        if r > 0:
            rows.append([t, c1[0] - c0[0] + c1[1] - c0[1], s1[0] - s0[0], s1[1] - s0[1]])
        tokens = seqs[:, prompts.shape[1]:].tolist()
    per_rank = [None] * world
    dist.all_gather_object(per_rank, (int(os.environ.get("LOCAL_RANK", "0")), rows))
    if rank == 0:
        Path(out).write_text(json.dumps({"per_rank": per_rank, "tokens": tokens}))
    dist.destroy_process_group()


def _measure(link: str, mode: str, a, k: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from zeropp.bench.cluster import Cluster
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    args = [__file__, "--rank-worker", "", mode, json.dumps(vars(a))]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        args[2] = out
        if link == "loopback":
            env = dict(os.environ, LOCAL_WORLD_SIZE="2")
            r = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "4", *args],
                               timeout=1800, env=env, capture_output=True, text=True)
            # A rank may abort in gloo's teardown after the result is written
            # ("terminate called without an active exception", seen with FSDP2).
            if r.returncode and not os.path.exists(out):
                raise SystemExit(f"{mode} on loopback failed:\n{(r.stdout + r.stderr)[-3000:]}")
        else:
            with Cluster(2, link, prefix="zppg") as c:
                procs = [c.popen(i, [torchrun, "--nnodes", "2", "--node-rank", str(i),
                                     "--nproc-per-node", "2", "--master-addr", c.addr(0),
                                     "--master-port", str(29800 + k), *args],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                         for i in range(2)]
                # A torchrun agent may sit minutes in its exit barrier after the
                # result is written (as in `zeropp bench`): give it 20 s, then stop it.
                deadline, done_at = time.monotonic() + 1800, None
                while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                    if os.path.exists(out):
                        done_at = done_at or time.monotonic()
                        if time.monotonic() - done_at > 20:
                            break
                    time.sleep(0.2)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                    p.wait()
        res = json.loads(Path(out).read_text())
    # Per round: the slowest rank's time; the busiest node's link bytes (each
    # node's ranks read the same counters); zeropp's accounting summed per node.
    per_rank = res["per_rank"]
    rounds = len(per_rank[0][1])
    t = [max(rows[i][0] for _, rows in per_rank) for i in range(rounds)]
    link_b = [max(rows[i][1] for lr, rows in per_rank if lr == 0) for i in range(rounds)]
    inter = [sum(rows[i][2] for _, rows in per_rank) / 2 for i in range(rounds)]
    intra = [sum(rows[i][3] for _, rows in per_rank) / 2 for i in range(rounds)]
    med = statistics.median
    return {"s": med(t), "link": med(link_b), "inter": med(inter), "intra": med(intra),
            "tokens": res["tokens"]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-worker":
        out, mode, a = sys.argv[2], sys.argv[3], argparse.Namespace(**json.loads(sys.argv[4]))
        _rank(out, mode, a)
        return
    p = argparse.ArgumentParser()
    p.add_argument("--links", default="loopback,100mbit")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--tokens", type=int, default=16, help="new tokens per rollout")
    p.add_argument("--batch", type=int, default=4, help="prompts per rank")
    p.add_argument("--rounds", type=int, default=2, help="timed rollouts (after one warm-up)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    modes = a.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode {bad[0]!r}; choose from {', '.join(MODES)}")
    lines = []
    for link in a.links.split(","):
        lines += ["", f"#### {link}", "",
                  "| mode | s / rollout | tokens/s (4 ranks) | speedup vs pertoken | link MB/node/rollout "
                  "(rx+tx) | link kB/token | accounted inter-node kB/node/token | accounted "
                  "intra-node kB/node/token | tokens = pertoken's |",
                  "|---|---|---|---|---|---|---|---|---|"]
        res = {}
        for k, mode in enumerate(modes):
            print(f"{link} {mode} ...", end=" ", flush=True)
            r = res[mode] = _measure(link, mode, a, k)
            print(f"{r['s']:.2f} s", flush=True)
        for mode, r in res.items():
            base = res.get(mode.rsplit("-", 1)[0] + "-pertoken")
            tps = 4 * a.batch * a.tokens / r["s"]
            acc = ("n/a", "n/a") if mode.startswith("fsdp2") else (
                f"{r['inter'] / a.tokens / 1e3:.0f}", f"{r['intra'] / a.tokens / 1e3:.0f}")
            vs = f"{base['s'] / r['s']:.2f}x" if base else "n/a"
            same = "n/a" if not base else "yes" if r["tokens"] == base["tokens"] else "no"
            wire = (("n/a", "n/a") if link == "loopback" else
                    (f"{r['link'] / 1e6:.2f}", f"{r['link'] / a.tokens / 1e3:.0f}"))
            lines.append(f"| {mode} | {r['s']:.2f} | {tps:.0f} | {vs} | {wire[0]} | {wire[1]} | "
                         f"{acc[0]} | {acc[1]} | {same} |")
    cmd = " ".join(sys.argv[1:])
    report([f"### Generation: per-token gathers vs gathered once ({time.strftime('%Y-%m-%d')})",
            "", f"Command: `python benchmarks/generate.py {cmd}`  ",
            f"HF GPT-2 ({a.n_layer} layers, {a.n_embd} wide, vocab {a.vocab}, fp32), 4 ranks "
            f"as 2 nodes x 2 (gloo, 1 thread per rank); each rollout: {a.batch} prompts of 8 "
            f"tokens per rank, {a.tokens} new tokens greedy with the KV cache, after a training "
            f"step (AdamW); median of {a.rounds} rollouts after a warm-up, the slowest rank's "
            "time. Link bytes: the busiest node's interface (loopback: none); accounted: "
            "zeropp's CommStats summed over a node's ranks (FSDP2 is not instrumented). "
            "fsdp2-unshard is FSDP2's counterpart of FSDP1's summon_full_params.",
            *lines], a.write)


if __name__ == "__main__":
    main()
