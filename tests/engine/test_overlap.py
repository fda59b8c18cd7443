"""Overlap (grads/pipeline.py, prefetch depth): gradient reduction on communication
threads and deeper prefetch change when collectives run, never what they compute
or what they move; a rank dying mid-backward fails the others by name."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cases import build, calm_and_crash, loss_of, train

import zeropp
from zeropp.cli.launch import spawn
from zeropp.collectives import CollectiveError
from zeropp.config import named
from zeropp.flat_grad import FlatGrad
from zeropp.train.loop import TrainArgs, train_worker


def _run(preset: str, d: int, steps: int, accum: int, **kw) -> tuple:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = zeropp.shard(build("gpt"), named(preset, d, **kw))
    losses, norms = train("gpt", "adamw", model, steps=steps, accum=accum, world=world,
                          rank=rank, clip=1.0, clip_fn=zeropp.clip_grad_norm_)
    shards = [f.primary_shard.detach().clone() for f in model._zeropp_state.flats]
    stats = zeropp.comm_stats(model)
    return losses, norms, shards, stats["inter_node_bytes"], stats["intra_node_bytes"]


def _async_vs_sync(preset: str, d: int) -> dict:
    out = {}
    for name, kw in {"sync": dict(async_reduce=False, prefetch_depth=1),
                     "async": dict(async_reduce=True, reduce_buckets=2, prefetch_depth=1),
                     "async-deep": dict(async_reduce=True, reduce_buckets=1, prefetch_depth=3)
                     }.items():
        out[name] = _run(preset, d, steps=10, accum=2 if preset == "zeropp" else 1, **kw)
        out[name + "/thread"] = any(t.name.startswith("zeropp-reduce") for t in threading.enumerate())
    return out


@pytest.mark.parametrize("preset", ["zeropp", "zeropp-plus"])
def test_async_reduction_and_deep_prefetch_are_bitwise_the_synchronous_path_over_10_steps(
        preset):
    """W=4 as 2x2, 10 steps (zeropp with 2 micro-batches of accumulation): losses,
    grad norms, final master shards and bytes identical, bit for bit."""
    for rank_out in spawn(_async_vs_sync, 4, 2, args=(preset, 2), timeout=400):
        assert not rank_out["sync/thread"] and rank_out["async/thread"]  # it really ran there
        sync = rank_out["sync"]
        for other in ("async", "async-deep"):
            got = rank_out[other]
            assert got[0] == sync[0] and got[1] == sync[1], other  # losses, norms
            assert all(torch.equal(a, b) for a, b in zip(got[2], sync[2])), other
            assert got[3:] == sync[3:], other  # inter- and intra-node bytes


def _rank1_stalls_in_backward(timeout: float, tmp: str) -> str:
    model = zeropp.shard(build("gpt"), named("zeropp", 2, collective_timeout=timeout))
    caught = [Path(tmp, f"caught{r}") for r in (0, 2, 3)]
    if dist.get_rank() == 1:  # stops inside its first gradient hook, mid-backward
        real = FlatGrad.take

        def stall(self):
            # until every other rank has failed (a file each), or timeout + 4 s at most
            end = time.monotonic() + timeout + 4
            while not all(p.exists() for p in caught) and time.monotonic() < end:
                time.sleep(0.05)
            return real(self)
        FlatGrad.take = stall
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    t0 = time.monotonic()
    try:
        loss_of("gpt", model, x, x).backward()
    except CollectiveError as e:
        elapsed = time.monotonic() - t0
        if dist.get_rank() != 1:
            Path(tmp, f"caught{dist.get_rank()}").touch()
        return f"{elapsed:.1f}|{e}"
    return "no error"


def test_a_rank_stalled_mid_backward_fails_the_others_within_the_timeout_naming_the_op(tmp_path):
    res = spawn(_rank1_stalls_in_backward, 4, 2, args=(2.0, str(tmp_path)), timeout=90)
    for rank in (0, 2, 3):
        assert "|" in res[rank], res[rank]
        elapsed, msg = res[rank].split("|", 1)
        assert float(elapsed) < 2.0 + 5.0, msg  # the timeout plus the forward
        # e.g. "zeropp: reduce_scatter/qgz/inter of unit h.3 did not complete within ..."
        assert re.match(r"zeropp: (reduce_scatter|all_gather)\S* of unit \S+ did not complete "
                        r"within the 2s collective_timeout", msg), msg


def _killed_mid_backward(a: TrainArgs, cfg, run_dir: str, tokens: str, vocab: int,
                         after: str) -> dict:
    """train_worker, but on the first attempt rank 1 SIGKILLs itself inside a
    gradient hook of the first backward after checkpoint `after` is the latest."""
    latest = Path(run_dir) / "checkpoints" / "latest"
    if dist.get_rank() == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        real, armed = FlatGrad.take, threading.Event()

        def take(self):
            if not armed.is_set() and latest.exists() and latest.read_text().strip() == after:
                armed.set()
            elif armed.is_set():  # the second hook of that backward: others are reducing
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self)
        FlatGrad.take = take
    return train_worker(a, cfg, run_dir, tokens, vocab)


def test_a_rank_killed_mid_backward_is_restarted_and_the_run_resumes_bit_exactly(
        tmp_path, capfd):
    a = TrainArgs(model="tiny", seq_len=32, batch=4, steps=14, save_every=5, eval_every=7,
                  eval_batches=2)
    cfg = named("zeropp", 2, collective_timeout=20.0)
    calm, crash = calm_and_crash(tmp_path, a, cfg, _killed_mid_backward, "step_000010")
    err = capfd.readouterr().err
    assert "rank 1 died (killed by SIGKILL)" in err and "restart 1 of 1" in err, err[-2000:]
    assert crash["start_step"] == 10
    assert crash["history"][-1]["train_loss"] == calm["history"][-1]["train_loss"]
    assert [r["step"] for r in crash["history"]] == list(range(14))


def test_bad_overlap_settings_are_refused_by_name():
    for field, bad in (("prefetch_depth", 0), ("reduce_buckets", 0), ("async_reduce", "yes")):
        with pytest.raises(ValueError, match=field):
            zeropp.Config(**{field: bad})


def test_the_pipeline_bounds_full_gradients_not_reductions_in_flight():
    """reduce_buckets=1: a hand-over waits while the previous unit's full gradient
    has not been through stage 1, and does not wait for its stage 2 (qgZ's
    inter-node hop on the slow link, which holds only a small piece)."""
    from zeropp.collectives import Comm
    from zeropp.grads.pipeline import ReducePipeline
    from zeropp.stats import CommStats
    from zeropp.topology import Topology
    topo = Topology(world_size=1, rank=0, node_size=1)
    comm = Comm(topo, CommStats(), groups={"world": None, "intra_node": None, "inter_node": None})
    pipe = ReducePipeline(comm, depth=1, asynchronous=True)
    gate1, gate2, log = threading.Event(), threading.Event(), []

    def first(tag, gate=None):
        def run(c):
            if gate is not None:
                gate.wait(30)
            log.append(("first", tag))
            return tag
        return run

    def second(c, tag):
        gate2.wait(30)
        log.append(("second", tag))

    def submit(tag, gate=None):
        pipe.submit(tag, torch.zeros(4), first(tag, gate), second)

    submit("a", gate1)                      # a's stage 1 is held
    b = threading.Thread(target=submit, args=("b",))
    b.start()
    b.join(0.5)
    assert b.is_alive()                     # a's full gradient is still waiting: b waits
    gate1.set()                             # a through stage 1; its stage 2 is held
    b.join(10)
    assert not b.is_alive()                 # b handed over while a's stage 2 still runs
    submit("c")                             # and c, once b's stage 1 is done
    assert ("second", "a") not in log
    gate2.set()
    pipe.drain()
    for stage in ("first", "second"):       # each stage in hand-over order
        assert [t for s, t in log if s == stage] == ["a", "b", "c"], log
