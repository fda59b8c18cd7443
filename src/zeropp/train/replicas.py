"""`zeropp train --replicas R`: R replica groups that may fail, zeropp inside each,
torchft across them.

Each replica group is its own torch.distributed world of `group_size` ranks (one
emulated node) training one model sharded by zeropp. torchft's Manager, one per
rank, joins the rank to the ranks of the same index in the other groups through
a lighthouse (started by the launcher, `torchft_lighthouse`) and a process group
wrapped by `zeropp.ft.wrap`, so what crosses between groups is zeropp's codec:
- `sync_every` 1: fault-tolerant HSDP. Every step each rank's gradient shards are
  averaged across the groups (torchft's OptimizerWrapper commits the step or not).
- `sync_every` H > 1: DiLoCo (torchft's): H inner AdamW steps, then the groups
  average their pseudo-gradients and an outer Nesterov SGD (lr 0.7, momentum 0.9)
  moves the shared weights.
`kill_at` SIGKILLs every rank of the last group at the start of that step; the
launcher starts it again once a survivor has taken `restart_after` more steps (the
survivors wait there until its Managers are up, so that a loaded machine's slow start
cannot let them finish alone), and it heals from a live group (weights, optimizer
state, DiLoCo's global weights and outer optimizer) before its first committed step. Rank 0 of each group writes
RUN/replica<g>/metrics.jsonl: loss, participants, committed, cross-node bytes.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
import warnings
import zlib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

import zeropp

from ..bench.cluster import enter_netns
from ..cli.launch import children_ignore_sigint
from .data import get_batch, split_tokens
from .loop import TrainArgs, _val_loss, build_model, lr_at


@dataclass
class ReplicaArgs:
    replicas: int = 2
    group_size: int = 2           # ranks per replica group (one emulated node)
    sync_every: int = 1           # H: 1 = HSDP every step, > 1 = DiLoCo
    outer_codec: str = "2bit"     # zeropp.ft codec between the groups
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    kill_at: Optional[int] = None  # step at whose start the last group is SIGKILLed
    restart_after: int = 30       # survivor steps before the killed group restarts
    timeout_s: float = 20.0       # torchft's collective and quorum timeouts
    lighthouse_timeout_ms: int = 5000  # a group silent this long is dead; a quorum waits
    # this long for a heartbeating group to ask
    digest: bool = False          # log a CRC of each group's weights + optimizer state
    fragments: int = 1            # > 1: Streaming DiLoCo, one fragment synced every H/F steps
    driver: str = "engine"        # inside a group: "engine" (zeropp.shard), "fsdp2" (FSDP2 +
    # zeropp.fsdp2.install) or "stock-fsdp2"; FSDP2's reduce-scatter output is averaged
    # across the groups by torchtitan's hook (H = 1 only)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lighthouse(log: Path, min_replicas: int = 1, netns: Optional[str] = None,
                     host: str = "127.0.0.1",
                     timeout_ms: int = 5000) -> tuple[subprocess.Popen, str]:
    """torchft's lighthouse, the membership service, as its own process (its log in
    `log`); inside network namespace `netns` (an emulated node at `host`) when given."""
    exe = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent)) \
        or shutil.which("torchft_lighthouse")
    if exe is None:
        raise RuntimeError("torchft_lighthouse not found: pip install 'zeropp[ft]'")
    port = _free_port()
    where = [] if netns is None else ["ip", "netns", "exec", netns]
    proc = subprocess.Popen([*where, exe, "--min_replicas", str(min_replicas),
                             "--quorum_tick_ms", "100", "--join_timeout_ms", str(timeout_ms),
                             "--heartbeat_timeout_ms", str(timeout_ms),
                             "--bind", f"[::]:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(log, "ab"),  # noqa: SIM115
                            env=dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "info")))
    probe = [*where, "bash", "-c", f"exec 3<>/dev/tcp/{host}/{port}"]
    deadline = time.time() + 30
    try:  # (a stop meanwhile, SIGTERM's Terminated too, must not leave it running)
        while time.time() < deadline:  # serving once it accepts a connection
            if subprocess.run(probe, capture_output=True).returncode == 0:
                return proc, f"http://{host}:{port}"
            if proc.poll() is not None:
                raise RuntimeError(f"torchft_lighthouse exited with {proc.returncode}")
            time.sleep(0.1)
        raise RuntimeError("torchft_lighthouse did not start listening within 30 s")
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard


def _digest(tensors: list[torch.Tensor]) -> int:
    crc = 0
    for t in tensors:
        crc = zlib.crc32(_local(t).detach().reshape(-1).contiguous().view(torch.uint8)
                         .numpy().tobytes(), crc)
    return crc


def _fully_shard(model: torch.nn.Module, size: int, cfg: Optional[zeropp.Config]) -> None:
    """FSDP2 over the group (a block each, then the root); zeropp's comms on it if
    `cfg`, stock FSDP2's otherwise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (size,))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if cfg is not None:
        import zeropp.fsdp2
        zeropp.fsdp2.install(model, cfg)


def _replica_mean_hook(model: torch.nn.Module, manager) -> None:
    """torchtitan's fault-tolerant HSDP, as it writes it (torchtitan/experiments/torchft/
    manager.py): every FSDP module's reduce-scatter output is averaged across the
    replica groups by an all-reduce hook on torchft's managed group."""
    from torch.distributed.fsdp import FSDPModule
    from torchft.process_group import ManagedProcessGroup
    replicate = ManagedProcessGroup(manager)
    replicate.register("dp_replicate")

    def all_reduce_hook(output: torch.Tensor) -> None:
        dist.all_reduce(output, group=replicate, op=dist.ReduceOp.AVG)

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(all_reduce_hook)


def _fragments(params: list[torch.Tensor], n: int) -> list[torch.nn.Module]:
    """`params` in order as `n` contiguous fragments of about equal size (Streaming
    DiLoCo's; n = 1: the whole model), each a module holding its parameters."""
    if not 1 <= n <= len(params):
        raise ValueError(f"fragments={n} is invalid: the model has {len(params)} sharded "
                         "parameters to split")
    total, starts, acc = sum(p.numel() for p in params), [0], 0
    for i, p in enumerate(params[:-1]):
        acc += p.numel()
        need = n - len(starts)
        if need and (acc >= total * len(starts) / n or len(params) - i - 1 == need):
            starts.append(i + 1)
    mods = []
    for a, b in zip(starts, [*starts[1:], len(params)]):
        m = torch.nn.Module()
        m.params = torch.nn.ParameterList(params[a:b])
        mods.append(m)
    return mods


def _opt_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]


def _group_crc(tensors: list[torch.Tensor]) -> int:
    """One CRC over every rank's shards of the group (ranks in order)."""
    mine = torch.tensor([_digest(tensors)], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return zlib.crc32(torch.cat(every).numpy().tobytes())


def replica_worker(rank: int, group: int, host: str, port: int, lighthouse: str,
                   a: TrainArgs, cfg: zeropp.Config, ra: ReplicaArgs, run_dir: str,
                   tokens_file: str, vocab: int, attempt: int) -> None:
    os.environ.setdefault("RUST_LOG", "error")  # torchft's quorum chatter, every step
    logging.getLogger("torchft").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(ra.group_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank,
                            world_size=ra.group_size, timeout=timedelta(seconds=300))
    out = Path(run_dir) / f"replica{group}"
    ids = torch.load(tokens_file, weights_only=True).long()
    train_ids, val_ids = split_tokens(ids, a.seq_len)
    model = build_model(a, vocab)
    if ra.driver == "engine":
        zeropp.shard(model, cfg)
    else:
        _fully_shard(model, ra.group_size, cfg if ra.driver == "fsdp2" else None)
    inner = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay,
                              betas=(0.9, 0.95))
    params = dict(model.named_parameters())

    def state_dict() -> dict:
        if ra.driver != "engine":  # torchft's transport sends plain tensors
            return {"model": {k: _local(p).detach().clone() for k, p in params.items()}}
        return {"model": {k: p.detach().clone() for k, p in params.items()},
                "inner": inner.state_dict()}

    def load_state_dict(sd: dict) -> None:
        if ra.driver != "engine":
            raise NotImplementedError("healing an FSDP2 replica group is not written: "
                                      "its optimizer state is DTensors")
        with torch.no_grad():  # in place: zeropp's version counters see the new weights
            for k, p in params.items():
                p.copy_(sd["model"][k])
        inner.load_state_dict(sd["inner"])

    if attempt > 0:  # started early (imports, model) and held until the launcher says go
        while not (out / "go").exists():
            time.sleep(0.05)
    pg = zeropp.ft.wrap(ProcessGroupGloo(timeout=timedelta(seconds=ra.timeout_s)),
                        ra.outer_codec)
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=f"replica{group}",
                      store_addr=host, store_port=port, rank=rank, hostname=host,
                      world_size=ra.group_size, lighthouse_addr=lighthouse,
                      timeout=timedelta(seconds=ra.timeout_s),
                      quorum_timeout=timedelta(seconds=3 * ra.timeout_s),
                      use_async_quorum=False,
                      init_sync=ra.driver == "engine")  # FSDP2: the same seed, the same init
    if ra.fragments > 1:
        pg.follow_fragments(manager, ra.fragments)
    if ra.driver != "engine":
        _replica_mean_hook(model, manager)
    victim = Path(run_dir) / f"replica{ra.replicas - 1}"
    if attempt > 0:  # heartbeating: the survivors' next quorum waits (the join timeout)
        (out / f"joined{rank}").touch()  # for its first one
    H = ra.sync_every
    P = H // ra.fragments  # steps between syncs: of the whole model, or of one fragment
    diloco = outer = None
    if H > 1:
        frags = _fragments(list(model.parameters()), ra.fragments)
        outer = [torch.optim.SGD(f.parameters(), lr=ra.outer_lr, momentum=ra.outer_momentum,
                                 nesterov=ra.outer_momentum > 0) for f in frags]
        # one flat buffer per sync (torchft's bucketization): every value quantized, not
        # each small tensor sent exact
        diloco = DiLoCo(manager, frags, inner, outer, sync_every=H, pin_memory=False,
                        use_bucketization=True)
        diloco.__enter__()
        opt = inner
    else:
        opt = OptimizerWrapper(manager, inner)
    if attempt == 0:  # every group's first quorum holds all of them: none starts alone
        (out / f"ready{rank}").touch()
        while len(list(Path(run_dir).glob("replica*/ready*"))) < ra.replicas * ra.group_size:
            time.sleep(0.05)
        time.sleep(0.5)  # the last Manager's heartbeats (every 100 ms) reach the
        # lighthouse, over a link with delay too, before any group asks for a quorum,
        # which would otherwise hold that group alone
    metrics = open(out / "metrics.jsonl", "a") if rank == 0 else None  # noqa: SIM115
    try:
        local = 0  # DiLoCo: inner steps since this process started
        last_sync = {"cross_node_bytes": 0.0}
        waiting = ra.kill_at is not None and group != ra.replicas - 1  # for a restart
        while True:
            step = manager.current_step() * P + local % P
            if ra.kill_at is not None and attempt == 0 and group == ra.replicas - 1 \
                    and step == ra.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # the whole group dies here, every rank
            if waiting and (victim / "go").exists():
                # the restart happens at this step: survivors wait for its Managers to be
                # up (then the lighthouse holds their quorum for its first request),
                # however long a loaded machine takes to start them
                deadline = time.time() + 120
                while len(list(victim.glob("joined*"))) < ra.group_size \
                        and time.time() < deadline:
                    time.sleep(0.02)
                waiting = False
            if step >= a.steps:  # done: no quorum for a step that will not run (a rank
                break            # leaving one would close its Manager's server under its peer)
            t0 = time.perf_counter()
            zeropp.reset_comm_stats(pg)
            opt.zero_grad()  # HSDP: OptimizerWrapper starts the step's quorum here (a
            step = manager.current_step() * P + local % P  # (a healed step)
            if step >= a.steps:
                break
            for g in inner.param_groups:
                g["lr"] = lr_at(step, a)
            gen = torch.Generator().manual_seed(a.seed * 100_003 + group * 1009 + rank * 7 + step)
            x, y = get_batch(train_ids, a.batch, a.seq_len, gen)
            _, loss = model(x, y)
            loss.backward()
            if H == 1 and ra.driver == "engine":  # the replicas' mean of the gradient
                # shards as one flat buffer (FSDP2: the hook does it)
                grads = [p.grad for p in model.parameters()]  # (as DDP's bucket: one
                flat = torch.cat([g.reshape(-1) for g in grads])  # round trip, not many)
                manager.allreduce(flat).wait()
                for g, v in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(v.view_as(g))
            if ra.driver == "engine":
                zeropp.clip_grad_norm_(model, a.clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
            before = manager.current_step()
            opt.step()  # HSDP: commits or not; DiLoCo: every H-th one syncs
            local += 1
            synced = local % P == 0
            committed = manager.current_step() > before
            if synced and committed:  # a healed replica's sync lands it on the others' step
                step = manager.current_step() * P - 1
            if H > 1 and synced:
                zeropp.refresh(model)  # DiLoCo wrote the weights through .data
            s = zeropp.comm_stats(pg)
            v = torch.tensor([loss.item() / ra.group_size, s["inter_node_bytes"]],
                             dtype=torch.float64)
            dist.all_reduce(v)
            row = {"step": step, "train_loss": v[0].item(), "cross_node_bytes": v[1].item(),
                   "participants": manager.num_participants() if synced else None,
                   "committed": committed if synced else None,
                   "manager_step": manager.current_step(), "attempt": attempt,
                   "step_time": time.perf_counter() - t0, "wall": time.time()}
            if ra.digest and synced:
                row["digest"] = _group_crc(list(params.values()) + [
                    t for o in (outer or [inner]) for t in _opt_tensors(o)])
            # at the first sync at or after each eval point (DiLoCo's weights are the
            # groups' common ones only there), and at the end
            crossed = (step + 1) // a.eval_every > (step + 1 - P) // a.eval_every
            if synced and (crossed or step + 1 >= a.steps):
                row["val_loss"] = _val_loss(model, val_ids, a, rank, ra.group_size)
            if metrics is not None:
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                if synced:
                    last_sync = row
                if step % a.log_every == 0:
                    print(f"replica {group} step {step:5d} | loss {row['train_loss']:.3f} | "
                          f"participants {manager.num_participants()} | cross-node "
                          f"{last_sync['cross_node_bytes'] / 1e6:.3f} MB at the last sync",
                          flush=True)
        dist.barrier()  # the group's ranks leave together: rank 0 serves their Manager RPCs
    finally:
        if metrics is not None:
            metrics.close()
        if diloco is not None:
            diloco.__exit__(None, None, None)
        manager.shutdown(wait=False)
        dist.destroy_process_group()


def _entry(rank: int, netns: Optional[str], *args) -> None:
    try:
        if netns is not None:  # an emulated node: gloo and torchft on its link
            enter_netns(netns, hostname=args[1])
            os.environ["GLOO_SOCKET_IFNAME"] = "cl0"
        replica_worker(rank, *args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def _start_group(ctx, group: int, lighthouse: str, a, cfg, ra, run_dir, tokens_file, vocab,
                 attempt: int, cluster=None) -> list:
    port = _free_port()
    netns, host = (None, "127.0.0.1") if cluster is None else (cluster.ns(group),
                                                               cluster.addr(group))
    procs = [ctx.Process(target=_entry, args=(r, netns, group, host, port, lighthouse, a, cfg,
                                              ra, run_dir, tokens_file, vocab, attempt),
                         daemon=True)
             for r in range(ra.group_size)]
    with children_ignore_sigint():  # (Ctrl-C: the launcher stops them, no traceback each)
        for p in procs:
            p.start()
    return procs


def _last_step(f: Path) -> int:
    try:
        lines = f.read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else -1
    except (OSError, ValueError, KeyError):
        return -1


def run_replicas(a: TrainArgs, cfg: zeropp.Config, ra: ReplicaArgs, run_dir: Path,
                 tokens_file: Path, vocab: int, timeout: float = 3600.0, cluster=None) -> dict:
    """Start the lighthouse and every replica group; kill and restart one if asked;
    return each group's metrics rows. Raises RuntimeError naming a group that failed.
    `cluster` (an entered `zeropp.bench.cluster.Cluster` of `replicas` nodes): group g
    runs on node g, the lighthouse on node 0, everything between groups on the links."""
    ctx = mp.get_context("spawn")
    if cluster is not None and cluster.nodes != ra.replicas:
        raise ValueError(f"the cluster has {cluster.nodes} nodes for {ra.replicas} replica "
                         "groups; give one node per group")
    lh, addr = start_lighthouse(run_dir / "lighthouse.log",
                                netns=None if cluster is None else cluster.ns(0),
                                host="127.0.0.1" if cluster is None else cluster.addr(0),
                                timeout_ms=ra.lighthouse_timeout_ms)
    (run_dir / "lighthouse.txt").write_text(addr + "\n")
    groups: dict[int, list] = {}
    restarted = ra.kill_at is None
    try:
        for g in range(ra.replicas):
            (run_dir / f"replica{g}").mkdir(parents=True, exist_ok=True)
            groups[g] = _start_group(ctx, g, addr, a, cfg, ra, str(run_dir), str(tokens_file),
                                     vocab, 0, cluster)
        deadline = time.time() + timeout
        victim = ra.replicas - 1
        go = run_dir / f"replica{victim}" / "go"

        def check() -> None:
            for g, ps in groups.items():
                bad = [p.exitcode for p in ps if p.exitcode not in (None, 0)]
                killed = g == victim and not restarted and all(
                    p.exitcode == -signal.SIGKILL for p in ps)
                if bad and not killed:
                    raise RuntimeError(f"replica group {g} failed (exit codes "
                                       f"{[p.exitcode for p in ps]}); see its traceback above")

        while any(p.is_alive() for ps in groups.values() for p in ps):
            if time.time() > deadline:
                raise RuntimeError(f"replica groups still running after {timeout:.0f} s")
            if not restarted and any(p.exitcode == -signal.SIGKILL for p in groups[victim]):
                for p in groups[victim]:  # its ranks kill themselves one by one: the node
                    p.kill()              # is gone as soon as the first has
                    p.join()
            check()
            if not restarted and all(p.exitcode == -signal.SIGKILL for p in groups[victim]):
                # the new processes start at once and wait, ready, for the survivors' step
                groups[victim] = _start_group(ctx, victim, addr, a, cfg, ra, str(run_dir),
                                              str(tokens_file), vocab, 1, cluster)
                restarted = True
            if restarted and ra.kill_at is not None and not go.exists():
                survivor = max(_last_step(run_dir / f"replica{g}" / "metrics.jsonl")
                               for g in range(ra.replicas - 1))
                if not any(p.is_alive() for g in range(ra.replicas - 1) for p in groups[g]):
                    print(f"the survivors finished before step {ra.kill_at + ra.restart_after}"
                          f": replica group {victim} is not restarted", flush=True)
                    for p in groups[victim]:
                        p.kill()
                        p.join()
                    groups[victim] = []
                elif survivor >= ra.kill_at + ra.restart_after - 1:
                    print(f"replica group {victim} rejoins (survivors at step {survivor + 1})",
                          flush=True)
                    go.touch()
            time.sleep(0.2)
        check()
    finally:  # every worker killed before any is waited for: a group still running while
        # another dies fails in its all-reduce, and torchft logs that with a traceback
        for p in [p for ps in groups.values() for p in ps if p.is_alive()]:
            p.kill()
        for ps in groups.values():
            for p in ps:
                p.join(5)
        lh.kill()
        lh.wait()
    return {g: [json.loads(x) for x in (run_dir / f"replica{g}" / "metrics.jsonl")
                .read_text().splitlines()] for g in range(ra.replicas)}
