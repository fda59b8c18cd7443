"""zeropp inside torchft: the compressed all-reduce zeropp.ft gives torchft's Manager,
and replica groups (zeropp inside each) that lose a group and take it back: torchft's
lighthouse, its Manager and DiLoCo, a real SIGKILL of every rank of one group."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchft")

from cases import cli_error_line  # noqa: E402

import zeropp  # noqa: E402
from zeropp.bench.cluster import Cluster, available  # noqa: E402
from zeropp.cli.launch import spawn  # noqa: E402
from zeropp.config import named  # noqa: E402
from zeropp.ft import CompressedAllReduce  # noqa: E402
from zeropp.quant import QTensor  # noqa: E402
from zeropp.train.loop import TrainArgs, build_model, prepare_tokens  # noqa: E402
from zeropp.train.replicas import ReplicaArgs, run_replicas  # noqa: E402

N = 5000  # elements per all-reduce: 3 chunks of 1792 (7 blocks of 256) at W=3


def _rounds(codec: str, ef: bool, rounds: int, fragments: bool = False) -> dict:
    """`fragments`: as under Streaming DiLoCo, a round of another fragment (a tensor of
    the same size) after each, the round key naming the fragment."""
    rank, w = dist.get_rank(), dist.get_world_size()
    ar = CompressedAllReduce(codec, block_size=256, error_feedback=ef)
    fragment = [0]
    ar.round_key = lambda: fragment[0]
    got, want = torch.zeros(N), torch.zeros(N, dtype=torch.float64)
    firsts = []
    for r in range(rounds):
        xs = [torch.randn(N, generator=torch.Generator().manual_seed(1000 * r + k))
              for k in range(w)]
        t = xs[rank].clone()
        if fragments and r:
            fragment[0] = 1
            ar.new_round()
            other = 100 * torch.randn(N, generator=torch.Generator().manual_seed(7 * r + rank))
            ar.all_reduce_(dist.group.WORLD, other, dist.ReduceOp.SUM, rank, w)
            fragment[0] = 0
        ar.new_round()
        ar.all_reduce_(dist.group.WORLD, t, dist.ReduceOp.SUM, rank, w)
        truth = torch.stack(xs).double().sum(0)
        firsts.append(((t.double() - truth).norm() / truth.norm()).item())
        got += t
        want += truth
    every = [torch.empty(N) for _ in range(w)]
    dist.all_gather(every, got)
    return {"same": all(torch.equal(e, every[0]) for e in every), "got": got,
            "err": firsts[0], "acc_err": ((got.double() - want).norm() / want.norm()).item(),
            "stats": ar.stats.as_dict()}


def _codecs() -> dict:
    out = {(c, ef): _rounds(c, ef, 1 if c == "fp32" else 12)
           for c, ef in [("fp32", False), ("int8", False), ("int4", True), ("2bit", True),
                         ("2bit", False)]}
    out["fragments"] = _rounds("2bit", True, 12, fragments=True)
    ar = CompressedAllReduce("int8", block_size=256)  # 300 bf16 values: 800 bytes exact,
    t = torch.ones(300, dtype=torch.bfloat16)         # 1040 quantized (1600 in fp32)
    ar.all_reduce_(dist.group.WORLD, t, dist.ReduceOp.SUM, dist.get_rank(), 3)
    out["bf16"] = {"ops": list(ar.stats.as_dict()["by_op"]), "sum": t.tolist()}
    return out


def test_compressed_all_reduce_gives_every_rank_the_same_bits_counts_its_bytes_and_error_feedback_cuts_the_drift():
    """W=3 over gloo, 5000 values: every rank ends with the same bits for every codec;
    each rank sends 2 (W-1) pieces of one chunk's wire bytes per all-reduce (fp32: the
    ring's 2 (W-1)/W of 20,000 bytes); one all-reduce's relative error is at most 0.01
    (int8), 0.2 (int4), 0.6 (2 bits); over 12 rounds error feedback keeps the summed
    result within 0.15 at 2 bits, under half the drift without it; another fragment's
    rounds in between change none of a tensor's bits (Streaming DiLoCo); a small bf16
    tensor goes exact where its own ring is cheaper than the codec."""
    res = spawn(_codecs, 3, 3, timeout=120)
    for r in res:
        assert all(v["same"] for k, v in r.items() if k != "bf16"), r.keys()
    out = res[0]
    chunk = 7 * 256
    for (codec, _), v in [(k, v) for k, v in out.items() if isinstance(k, tuple)]:
        s = v["stats"]
        if codec == "fp32":
            assert s["inter_node_bytes"] == round(2 * 2 / 3 * N * 4) and v["err"] < 1e-6
            continue
        bits = {"int8": 8, "int4": 4, "2bit": 2}[codec]
        per = 2 * 2 * QTensor.wire_bytes(chunk, bits, 256)
        assert s["inter_node_bytes"] == 12 * per, (codec, s["inter_node_bytes"], per)
        assert s["scale_bytes"] == 12 * 2 * 2 * 7 * 4
    assert out[("int8", False)]["err"] < 0.01
    assert out[("int4", True)]["err"] < 0.2
    assert out[("2bit", True)]["err"] < 0.6
    assert out[("2bit", True)]["acc_err"] < 0.15
    assert out[("2bit", True)]["acc_err"] < 0.5 * out[("2bit", False)]["acc_err"]
    # another fragment's rounds in between (100x its values): this tensor's residuals are
    # its own, bit for bit those of the rounds without them (before: the other's were added)
    assert torch.equal(out["fragments"]["got"], out[("2bit", True)]["got"])
    # exact where its own dtype's ring is the cheaper (before: weighed as fp32, quantized)
    assert out["bf16"] == {"ops": ["allreduce/exact"], "sum": [3.0] * 300}


def test_wrap_names_what_is_wrong():
    with pytest.raises(TypeError, match="torchft process group"):
        zeropp.ft.wrap(object(), "2bit")
    from torchft.process_group import ProcessGroupGloo
    with pytest.raises(ValueError, match="codec='3bit' is invalid"):
        zeropp.ft.wrap(ProcessGroupGloo(), "3bit")
    with pytest.raises(ValueError, match="multiple of 16"):
        zeropp.ft.wrap(ProcessGroupGloo(), "2bit", block_size=100)
    with pytest.raises(ValueError, match="fragments=0 is invalid"):
        zeropp.ft.wrap(ProcessGroupGloo(), "2bit").follow_fragments(None, 0)



def test_set_timeout_reaches_the_wrapped_group_that_builds_the_backend():
    """(before: it set the wrapper's own timeout, which nothing reads: collectives kept
    the wrapped group's 60 s)"""
    from datetime import timedelta

    from torchft.process_group import ProcessGroupGloo
    inner = ProcessGroupGloo(timeout=timedelta(seconds=60))
    zeropp.ft.wrap(inner, "2bit").set_timeout(timedelta(seconds=5))
    assert inner._timeout == timedelta(seconds=5)

@pytest.mark.parametrize("args, says", [
    (["--replicas", "3"], "--replicas 3 must be at least 2 and divide --nproc 4"),
    (["--replicas", "2", "--sync-every", "8", "--fragments", "3"], "--fragments 3 must be"),
    (["--replicas", "2", "--sync-every", "8", "--fragments", "8"], "at most that many"),
    (["--replicas", "2", "--inside", "fsdp2", "--sync-every", "4"], "runs HSDP (--sync-every 1)"),
    (["--replicas", "2", "--link", "fast"], "unparsable link rate 'fast'"),
    (["--replicas", "2", "--link", "10mbit", "--link-delay", "soon"], "unparsable link delay"),
    # (these two trained: one micro-batch a step, no checkpoints, a mkdir traceback)
    (["--replicas", "2", "--accum", "4"], "it does not take --accum 4"),
    (["--replicas", "2", "--save-every", "10"], "it does not take --save-every 10"),
    (["--replicas", "2", "--out", "/dev/null"], "--out /dev/null: cannot create this directory"),
])
def test_replica_options_that_cannot_run_are_one_line_each(args, says, capsys):
    assert says in cli_error_line(["train", "--model", "tiny", *args], capsys)


def test_a_stop_while_the_lighthouse_starts_does_not_leave_it_running(tmp_path, monkeypatch):
    """SIGTERM's `Terminated` (here a KeyboardInterrupt, both BaseExceptions) in
    start_lighthouse's wait for it to listen left torchft_lighthouse running after the
    launcher had gone (a review's run: `zeropp train --replicas 2`, SIGTERM at once)."""
    import subprocess

    from zeropp.train import replicas
    started, popen = [], subprocess.Popen

    def start(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    def stop(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(subprocess, "Popen", start)
    monkeypatch.setattr(subprocess, "run", stop)  # (the probe of its port)
    with pytest.raises(KeyboardInterrupt):
        replicas.start_lighthouse(tmp_path / "lighthouse.log")
    assert len(started) == 1 and started[0].poll() is not None


def _run(tmp: Path, H: int, steps: int, kill, back: int, cluster=None) -> dict:
    a = TrainArgs(steps=steps, batch=4, seq_len=32, model="tiny", eval_every=10**9,
                  log_every=10**9, warmup=5)
    ids, vocab = prepare_tokens(a, Path.home() / ".cache" / "zeropp")
    tokens = tmp / "tokens.pt"
    torch.save(ids.to(torch.int32), tokens)
    ra = ReplicaArgs(replicas=2, group_size=2, sync_every=H, outer_codec="2bit", kill_at=kill,
                     restart_after=back, digest=True, timeout_s=10,
                     lighthouse_timeout_ms=3000)  # the dead group is let go sooner
    return run_replicas(a, named("zeropp-plus", 2), ra, tmp, tokens, vocab, timeout=240,
                        cluster=cluster)


# hsdp: the final validation loss 0.61x the first train loss at 50 steps (bound 0.8), 15
# syncs with group 0 alone; 0.56x at 100 steps
@pytest.mark.parametrize("H,steps,kill,back,link", [(1, 50, 16, 16, False),
                                                    (8, 128, 32, 40, True)],
                         ids=["hsdp", "diloco-h8-on-2-nodes"])
def test_a_killed_replica_group_heals_from_the_survivor_which_commits_every_step(
        tmp_path, H, steps, kill, back, link):
    """2 replica groups x 2 ranks, zeropp-plus inside, 2-bit + error feedback between;
    every rank of group 1 SIGKILLed at step `kill`, started again and let in when group 0
    reaches kill + back. Group 0 commits every sync (every step under HSDP) with 1
    participant while group 1 is gone and 2 again after; from its first committed sync
    on, group 1's weights and optimizer state (HSDP: AdamW's; DiLoCo: the outer
    Nesterov's, with the global weights) are group 0's bit for bit, at every sync both
    logged; no rank hangs (the launcher's 240 s bound). DiLoCo runs on two emulated
    nodes (network namespaces whose host names are their addresses, as torchft
    advertises them; the lighthouse on node 0) joined by a 100mbit link with 10 ms one
    way, where the restarted group's processes enter the node again: the TCP payload
    each node sent the other is at least what zeropp counted its group sending."""
    if link and not available()[0]:
        pytest.skip(f"no emulated cluster here: {available()[1]}")
    cluster = Cluster(2, "100mbit", prefix="zppft", delay="10ms") if link else None
    if cluster is None:
        groups = _run(tmp_path, H, steps, kill, back)
    else:
        with cluster:
            groups = _run(tmp_path, H, steps, kill, back, cluster=cluster)
        for g, rows in groups.items():
            counted = sum(r["cross_node_bytes"] for r in rows)
            assert 0 < counted <= sum(f[5] for f in cluster.flows if f[0] == g), (g, counted)
    syncs = [{r["step"]: r for r in rows if r["committed"] is not None}
             for rows in groups.values()]
    s0, s1 = syncs
    assert sorted(s0) == list(range(H - 1, steps, H))  # every sync of the run, once each
    assert all(r["committed"] for r in s0.values())
    assert {s0[s]["participants"] for s in s0 if kill + H <= s < kill + back} == {1}
    assert s0[steps - 1]["participants"] == 2
    back_in = sorted(s for s, r in s1.items() if r["attempt"] == 1 and r["committed"])
    assert back_in and back_in[0] >= kill + back - 1 and back_in[-1] == steps - 1
    assert all(s0[s]["digest"] == s1[s]["digest"] for s in back_in)
    before = [s for s in s1 if s < kill]
    assert before and all(s0[s]["digest"] == s1[s]["digest"] for s in before)
    # the run learnt, and the two groups ended on the same validation loss
    v0, v1 = groups[0][-1]["val_loss"], groups[1][-1]["val_loss"]
    assert v0 == v1 and math.isfinite(v0) and v0 < 0.8 * groups[0][0]["train_loss"]
    lines = (tmp_path / "replica0" / "metrics.jsonl").read_text().splitlines()
    assert all("cross_node_bytes" in json.loads(x) for x in lines)


def test_fsdp2_with_zeropp_inside_groups_composes_with_torchtitans_replica_hook(tmp_path):
    """FSDP2 in each group (a block each, then the root) with zeropp.fsdp2.install
    (zeropp-plus), the groups' mean by the all-reduce hook torchtitan's fault-tolerant
    HSDP sets (dist.all_reduce on torchft's managed group), 2 bits between the groups:
    the hook runs on zeropp's reduce-scatter output, so the two groups' weights are
    equal bit for bit after each of the 8 steps (each group alone would drift apart:
    different data), every step commits with both, the loss falls, and the bytes
    between the groups are the 2-bit codec's. (zero3 + the hook against stock FSDP2 +
    the hook, loss for loss: tests/fsdp2/test_fsdp2_nd.py's hooked HSDP run.)"""
    a = TrainArgs(steps=8, batch=4, seq_len=32, model="tiny", eval_every=10**9,
                  log_every=10**9, warmup=5)
    ids, vocab = prepare_tokens(a, Path.home() / ".cache" / "zeropp")
    torch.save(ids.to(torch.int32), tmp_path / "tokens.pt")
    ra = ReplicaArgs(replicas=2, group_size=2, sync_every=1, outer_codec="2bit",
                     digest=True, timeout_s=10, driver="fsdp2")
    groups = run_replicas(a, named("zeropp-plus", 2), ra, tmp_path, tmp_path / "tokens.pt",
                          vocab, timeout=240)
    assert [r["digest"] for r in groups[0]] == [r["digest"] for r in groups[1]]
    assert len(groups[0]) == 8 and all(r["committed"] and r["participants"] == 2
                                       for g in groups.values() for r in g)
    assert groups[0][-1]["train_loss"] < groups[0][0]["train_loss"]
    sent = groups[0][-1]["cross_node_bytes"]  # 2 bits a value + scales, both ranks' shards
    assert 0 < sent < 0.1 * 4 * sum(p.numel() for p in build_model(a, vocab).parameters())


def test_streaming_fragments_split_the_units_in_order_into_about_equal_parts():
    """Streaming DiLoCo's fragments (train/replicas.py): every parameter once, in
    order, no fragment empty, none above its share by more than one unit; more
    fragments than units is one clear error."""
    from zeropp.train.replicas import _fragments
    sizes = [24960, 198656, 198656, 198656, 198656, 7]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    for n in (1, 2, 3, 6):
        frags = [list(f.parameters()) for f in _fragments(params, n)]
        assert len(frags) == n and all(frags)
        assert [id(p) for f in frags for p in f] == [id(p) for p in params]
        share = sum(sizes) / n
        assert all(sum(p.numel() for p in f) < share + max(sizes) for f in frags)
    with pytest.raises(ValueError, match="fragments=7 is invalid: the model has 6"):
        _fragments(params, 7)
