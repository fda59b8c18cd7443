"""The engine's device path in one command: what a GPU task runs first.

    python benchmarks/conformance/gpu_check.py                 # CUDA when available, bounded to ~8 min
    python benchmarks/conformance/gpu_check.py --device cpu    # the same checks on the CPU (in make test)
    python benchmarks/conformance/gpu_check.py --json out.json # also write the rows as JSON

Checks, each a row (ok / FAILED, what was measured, seconds):
  train        4 ranks as 2 nodes x 2 sharing the device over gloo (CUDA tensors on a
               GPU), a tiny
               GPT for 4 steps under zero3, zeropp and zeropp-plus: finite losses,
               every rank's master shards bitwise equal to what one rank gathers,
               and zero3's losses equal one unsharded process's (fp32, TF32 off);
               zeropp-plus again with bf16 compute (param_dtype), within 2% of it
  w1           one rank on the device's own backend (NCCL on a GPU, gloo on the CPU)
  hf_load      Hugging Face's from_pretrained under ZeRO-3 (HfDeepSpeedConfig alive, the
               alias) at W=1 on the device's own backend: every parameter partitioned
               from construction (DeepSpeed's look, 0 elements), its values the
               checkpoint's bit for bit; initialize on the device, the first loss the
               plain load's (fp32, to 1e-5)
  pipeline     the reduce pipeline on its side stream / threads (async_reduce) vs
               the synchronous path, zeropp-plus: bitwise equal weights after 4 steps
  fsdp2        the same GPT under stock FSDP2 (`fully_shard` per block and on the root,
               a mesh of the device's type) with `zeropp.fsdp2.install`, in the same
               world: zero3's losses equal one unsharded process's (fp32, to 1e-5);
               zero3 and zeropp-plus each give every rank the same probe loss (the
               same gathered weights), count every step, and zeropp-plus's ranks
               send fewer bytes across nodes than zero3's
  quant        INT8 and INT4 blockwise quantize + dequantize of 64 MiB (CPU: 16 MiB)
               into preallocated outputs, against a copy of the same bytes: GB/s, eager
               and compiled (zeropp/kernels.py; Triton on a GPU), whose wire bytes and
               dequantized values must equal the eager ones bit for bit
  codecs       the compiled codecs against the eager ones on codec_cases.py's inputs
               (zero, subnormal, -0.0, NaN, Inf and NaN-payload blocks; fp32 / bf16 /
               fp16; odd offsets; several chunks; with and without the sender's copy):
               every byte equal, per bit width
  qwd          qWD's INT4 code deltas: owner and holder copies bitwise equal on the
               device; whether the CPU's bytes for the same moves are the same;
               encode / apply ms and host syncs
  memory       memory_stats per preset after training, and the device's peak
Exit status 1 if any check fails. Nothing here is a pass/fail timing: throughput
rows are measurements.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zeropp
from zeropp.cli.launch import spawn
from zeropp.train.model import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import codec_cases  # noqa: E402  (the compiled codecs' byte cases: a fixture of the tests)

STEPS, WORLD, NODE = 4, 4, 2  # 2 emulated nodes x 2 ranks: every route runs
PRESETS = ["zero3", "zeropp", "zeropp-plus"]
FSDP2 = ["zero3", "zeropp-plus"]


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32,
                         bias=False)).to(device)


def _batch(step: int, world: int, rank: int | None, device: str):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 64, (2 * world, 16), generator=g)
    y = torch.randint(0, 64, (2 * world, 16), generator=g)
    if rank is not None:
        x, y = x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]
    return x.to(device), y.to(device)


def _loss(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = m(x)
    logits = logits[0] if isinstance(logits, tuple) else logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _steps(m: torch.nn.Module, device: str, rank: int | None) -> tuple[list, torch.optim.Optimizer]:
    """STEPS AdamW steps; the losses as the whole batch's mean (all ranks' when sharded)."""
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    losses = []
    for step in range(STEPS):
        loss = _loss(m, *_batch(step, WORLD, rank, device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().float().reshape(1)
        if rank is not None:
            dist.all_reduce(t)
            t /= dist.get_world_size()
        losses.append(t.item())
    return losses, opt


def _train(device: str, cfg: zeropp.Config) -> dict:
    """One rank's run: losses, whether the ranks' consolidated weights agree."""
    rank = dist.get_rank()
    m = zeropp.shard(_model(device), cfg)
    losses, opt = _steps(m, device, rank)
    full = zeropp.full_state_dict(m, all_ranks=True)
    digest = torch.cat([v.float().reshape(-1).cpu() for _, v in sorted(full.items())])
    mine = digest.clone()
    if dist.get_backend() == "nccl":  # NCCL moves CUDA tensors only
        digest = digest.cuda()
    dist.broadcast(digest, src=0)
    digest = digest.cpu()
    return {"losses": losses, "same_on_every_rank": bool(torch.equal(mine, digest)),
            "weights": digest.tolist() if rank == 0 else None,
            "memory": zeropp.memory_stats(m, opt),
            "peak": (torch.cuda.max_memory_allocated() if device == "cuda"
                     else zeropp.get_accelerator().max_memory_allocated())}


def _train_each(device: str, cfgs: list) -> list[dict]:
    """`_train` for each Config in turn, in one world (a world's start is most of a
    small run's time), each with its own seconds."""
    out = []
    for cfg in cfgs:
        gc.collect()  # the last run's model, before this run's peak is measured
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        else:
            zeropp.get_accelerator().reset_peak_memory_stats()
        t0 = time.perf_counter()
        out.append({**_train(device, cfg), "seconds": time.perf_counter() - t0})
    return out


def _fsdp2(device: str, preset: str) -> dict:
    """One rank's FSDP2 run under `install(preset)`: losses, the probe loss on a batch
    every rank shares, the steps and inter-node bytes zeropp counted."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import zeropp.fsdp2
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    m = _model(device)
    for block in m.h:
        fully_shard(block, mesh=mesh)
    fully_shard(m, mesh=mesh)
    zeropp.fsdp2.install(m, preset, node_size=NODE)
    t0 = time.perf_counter()
    losses, _ = _steps(m, device, dist.get_rank())
    with torch.no_grad():
        probe = torch.tensor([_loss(m, *_batch(99, 1, None, device)).item()], dtype=torch.float64)
    probes = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(probes, probe)  # CPU tensors: any backend's all-gather takes them
    stats = zeropp.comm_stats(m)
    inter = torch.tensor([stats["inter_node_bytes"]], dtype=torch.int64)
    dist.all_reduce(inter)  # every rank's: on a ring only a node's last rank sends across
    return {"losses": losses, "probes": [t.item() for t in probes], "steps": stats["steps"],
            "inter_node_bytes": int(inter),
            "seconds": time.perf_counter() - t0}


def _train_world(device: str, cfgs: list) -> tuple[list[dict], list[dict]]:
    """The engine's runs, then FSDP2's, in one world."""
    return _train_each(device, cfgs), [_fsdp2(device, p) for p in FSDP2]


def _reference(device: str) -> list[float]:
    """One unsharded process on the whole batch."""
    return _steps(_model(device), device, None)[0]


def check_train(device: str, timeout: float) -> list[dict]:
    """Each preset against one process; then, in the same world, zeropp-plus again with
    its reductions on the calling thread: the reduce pipeline's bits must be the same."""
    rows, ref = [], _reference(device)
    presets = PRESETS + ["zeropp-plus bf16"]
    cfgs = [zeropp.Config.preset(p.split()[0], node_size=NODE,
                                 **({"param_dtype": torch.bfloat16} if " " in p else {}))
            for p in presets]
    cfgs.append(zeropp.Config.preset("zeropp-plus", node_size=NODE, async_reduce=False))
    t0 = time.perf_counter()
    runs, fsdp2 = spawn(_train_world, WORLD, node_size=NODE, args=(device, cfgs),
                        timeout=timeout * (len(cfgs) + len(FSDP2)))[0]
    same = runs[PRESETS.index("zeropp-plus")]["weights"] == runs[-1]["weights"]
    pipeline = {"check": "pipeline async == sync", "ok": same,
                "measured": f"bitwise equal weights after {STEPS} steps: {same}",
                "seconds": time.perf_counter() - t0}
    for preset, r in zip(presets, runs):
        dtype = preset.split()[1:]
        finite = all(map(lambda v: v == v and abs(v) < 1e9, r["losses"]))
        ok = finite and r["same_on_every_rank"]
        worst = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
        if preset == "zero3":
            ok = ok and worst <= 1e-5
        elif dtype:  # bf16 compute: near the fp32 reference, not equal to it
            ok = ok and worst <= 0.02
        rows.append({"check": f"train {preset}", "ok": ok,
                     "measured": f"losses {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}; "
                                 f"vs one process max rel {worst:.1e}; ranks equal "
                                 f"{r['same_on_every_rank']}",
                     "seconds": r["seconds"], "memory": r["memory"],
                     "peak": r["peak"]})
    return rows + [pipeline] + _fsdp2_rows(fsdp2, ref)


def _fsdp2_rows(runs: list[dict], ref: list[float]) -> list[dict]:
    rows, zero3_bytes = [], runs[FSDP2.index("zero3")]["inter_node_bytes"]
    for preset, r in zip(FSDP2, runs):
        finite = all(v == v and abs(v) < 1e9 for v in r["losses"])
        same = len(set(r["probes"])) == 1
        worst = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
        ratio = r["inter_node_bytes"] / zero3_bytes if zero3_bytes else float("nan")
        ok = finite and same and r["steps"] == STEPS and (
            worst <= 1e-5 if preset == "zero3" else ratio < 1.0)
        rows.append({"check": f"fsdp2 {preset}", "ok": ok,
                     "measured": f"losses {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}; "
                                 f"vs one process max rel {worst:.1e}; probe equal on every "
                                 f"rank {same}; steps counted {r['steps']}; inter-node bytes "
                                 f"{r['inter_node_bytes']:,} ({ratio:.3f}x zero3's)",
                     "seconds": r["seconds"]})
    return rows


def _w1(device: str) -> dict:
    return _train(device, zeropp.Config.preset("zeropp", node_size=1))


def check_w1(device: str, timeout: float) -> dict:
    t0 = time.perf_counter()
    backend = "nccl" if device == "cuda" else "gloo"
    r = spawn(_w1, 1, args=(device,), timeout=timeout, backend=backend)[0]
    ok = all(v == v for v in r["losses"])
    return {"check": f"w1 ({backend})", "ok": ok,
            "measured": f"losses {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}",
            "seconds": time.perf_counter() - t0}


HF_DS = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
         "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


def _hf_load(root: str, device: str) -> dict:
    import zeropp as alias
    alias.install_as_deepspeed()  # before transformers, as a user's script does
    import deepspeed
    import transformers as tf
    from safetensors.torch import load_file
    from transformers.integrations import HfDeepSpeedConfig
    keep = HfDeepSpeedConfig(HF_DS)  # noqa: F841 (transformers holds it weakly)
    model = tf.GPT2LMHeadModel.from_pretrained(root)
    params = list(model.named_parameters())
    look = all(p.numel() == 0 and hasattr(p, "ds_tensor") for _, p in params)
    ckpt = load_file(str(Path(root) / "model.safetensors"))
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        same = all(torch.equal(p.detach().cpu(), ckpt[n]) for n, p in params if n in ckpt)
    engine, *_ = deepspeed.initialize(model=model, config=HF_DS)
    x = torch.arange(16, device=device).reshape(2, 8) % 50
    with torch.no_grad():
        loss = engine(input_ids=x, labels=x).loss.item()
    return {"look": look, "same": same, "loss": loss}


def check_hf_load(device: str, timeout: float) -> dict:
    import tempfile

    import transformers as tf
    t0 = time.perf_counter()
    backend = "nccl" if device == "cuda" else "gloo"
    torch.manual_seed(0)
    gpt = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_positions=16, n_embd=32,
                                           n_layer=2, n_head=2))
    x = torch.arange(16).reshape(2, 8) % 50
    with tempfile.TemporaryDirectory() as root:
        gpt.save_pretrained(root)
        with torch.no_grad():
            plain = gpt.to(device).eval()(input_ids=x.to(device), labels=x.to(device)).loss.item()
        r = spawn(_hf_load, 1, args=(root, device), timeout=timeout, backend=backend)[0]
    ok = r["look"] and r["same"] and abs(r["loss"] - plain) <= 1e-5 * abs(plain)
    return {"check": f"hf_load ({backend})", "ok": ok,
            "measured": f"partitioned {r['look']}, values the checkpoint's {r['same']}, "
                        f"first loss {r['loss']:.6f} (plain load {plain:.6f})",
            "seconds": time.perf_counter() - t0}


def check_quant(device: str) -> list[dict]:
    from zeropp import kernels
    from zeropp.quant import dequantize, quantize
    n = (64 if device == "cuda" else 16) * 2**20 // 4
    x = torch.randn(n, device=device)
    out, dst = torch.empty_like(x), torch.empty_like(x)

    def best(f, reps: int = 5) -> float:
        f()
        times = []
        for _ in range(reps):
            zeropp.get_accelerator().synchronize()
            t0 = time.perf_counter()
            f()
            zeropp.get_accelerator().synchronize()
            times.append(time.perf_counter() - t0)
        return min(times)
    copy = best(lambda: dst.copy_(x))
    rows = []
    for bits in (8, 4):
        wires = {}
        for mode in ("eager", "compiled"):  # compiled: zeropp/kernels.py (Triton on a GPU)
            with codec_cases.compiled(mode == "compiled"):
                q = quantize(x, bits, 2048)
                wires[mode] = (q.to_bytes().clone(), dequantize(q).clone(),
                               dequantize(q, torch.bfloat16).clone())
                wire = torch.empty_like(wires[mode][0])
                t = best(lambda b=bits, w=wire: dequantize(quantize(x, b, 2048, out=w),
                                                           out=out))
            err = ((out - x).norm() / x.norm()).item()
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                       for a, b in zip(wires["eager"], wires[mode]))
            rows.append({"check": f"quant int{bits} {mode}",
                         "ok": err < (0.02 if bits == 8 else 0.2) and same and not kernels._failed,
                         "measured": f"{x.nbytes / t / 1e9:.1f} GB/s vs copy "
                                     f"{x.nbytes / copy / 1e9:.1f} GB/s ({t / copy:.1f}x); rel err "
                                     f"{err:.4f}; bytes equal to eager: {same}",
                         "seconds": t})
    return rows


def check_codecs(device: str) -> list[dict]:
    """codec_cases.mismatches on the device, per bit width. On
    the CPU (make test) its first case only: tests/comm/test_kernels.py runs them all there,
    and each case's kernel variants cost seconds to compile from a cold cache."""
    from zeropp import kernels
    rows, cases = [], codec_cases.CASES[:1] if device == "cpu" else codec_cases.CASES
    for bits in (8, 4):
        t0 = time.perf_counter()
        bad = codec_cases.mismatches(bits, device=device, cases=cases)
        rows.append({"check": f"codecs int{bits} compiled == eager",
                     "ok": not bad and not kernels._failed,
                     "measured": ("every byte equal over " if not bad else
                                  f"{len(bad)} differ, first: {bad[0]}; of ")
                     + f"{len(cases)} cases"
                     + ("; compile FAILED" if kernels._failed else ""),
                     "seconds": time.perf_counter() - t0})
    return rows


def check_qwd(device: str) -> dict:
    """qWD's code deltas on the device: 20 INT4 moves of a 1M-value shard (a tenth of
    the blocks moving far, so both formulas run), the holder's copy bitwise the
    owner's, and whether both are bitwise what the same ops give on the CPU."""
    from zeropp import qwd
    from zeropp.quant import quantize
    t0 = time.perf_counter()
    n, block = 2**20, 2048
    g = torch.Generator().manual_seed(0)
    m = torch.randn(n, generator=g) * 0.02
    copies = {d: quantize(m.to(d), 8, block).to_bytes().clone() for d in {device, "cpu"}}
    holder = copies[device].clone()
    same, first = True, _differs(copies, n, block)
    where = "at the initial quantize" if first else None
    for move in range(20):
        m = m + torch.randn(n, generator=g) * 2e-4
        m.view(-1, block)[::10] += torch.randn(n // block // 10 + 1, block, generator=g) * 0.01
        for d, c in copies.items():
            out = torch.empty(qwd.wire_bytes(n, block), dtype=torch.uint8, device=d)
            qwd.encode(m.to(d), c, out, block=block)
            if d == device:
                qwd.apply(holder, out, numel=n, block=block)
                same &= torch.equal(holder, c)
        if where is None and _differs(copies, n, block):
            where = f"from move {move + 1}"
    cpu_equal = torch.equal(copies[device].cpu(), copies["cpu"])
    vs_cpu = "True" if cpu_equal else f"False ({where}; {_differs(copies, n, block)})"
    enc, app, syncs = _qwd_cost(device, qwd, quantize)
    # A run never mixes devices: every rank's copies come from the same device's ops, so
    # the check is owner = holder; the CPU comparison says whether the device's float
    # ops are the CPU's bit for bit.
    return {"check": "qwd", "ok": same, "seconds": time.perf_counter() - t0,
            "measured": f"owner = holder on {device}: {same}; = CPU's bytes: {vs_cpu}; "
                        f"442K-value shard: encode {enc:.3f} ms, apply {app:.3f} ms, "
                        f"host syncs {syncs}"}


def _differs(copies: dict, n: int, block: int) -> str:
    """'' if every device's copy has the same bytes, else how many scales and codes
    differ, and by how many codes at most."""
    from zeropp.quant import QTensor
    if len(copies) == 1:
        return ""
    q = [QTensor.from_bytes(c.cpu(), (n,), torch.float32, 8, block) for c in copies.values()]
    scales = int((q[0].scales != q[1].scales).sum())
    codes = (q[0].data.int() - q[1].data.int()).abs()
    if not scales and not int(codes.amax()):
        return ""
    return f"{scales} scales and {int((codes > 0).sum())} codes differ, by <= {int(codes.amax())}"


def _qwd_cost(device: str, qwd, quantize) -> tuple[float, float, str]:
    """Milliseconds per encode and apply of a gpt-6x384-sized shard (442,368 values,
    216 blocks), best of 10; on CUDA also the host synchronisations each one makes
    (torch's sync debug mode counts them)."""
    import warnings
    n, block = 442368, 2048
    g = torch.Generator().manual_seed(1)
    m = (torch.randn(n, generator=g) * 0.02).to(device)
    copy = quantize(m, 8, block).to_bytes().clone()
    holder = copy.clone()
    out = torch.empty(qwd.wire_bytes(n, block), dtype=torch.uint8, device=device)
    m2 = m + (torch.randn(n, generator=g) * 2e-4).to(device)

    def enc():
        c = copy.clone()
        qwd.encode(m2, c, out, block=block)

    def app():
        qwd.apply(holder.clone(), out, numel=n, block=block)
    acc = zeropp.get_accelerator()
    times = {}
    for name, f in (("enc", enc), ("app", app)):
        f()
        best = float("inf")
        for _ in range(10):
            acc.synchronize()
            t0 = time.perf_counter()
            f()
            acc.synchronize()
            best = min(best, time.perf_counter() - t0)
        times[name] = best * 1e3
    syncs = "n/a (CPU)"
    if device == "cuda":
        counts = []
        for f in (enc, app):
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    f()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            # (not the one-time "debug mode is a prototype" note, which also says "Synchronization")
            counts.append(sum("synchroniz" in str(x.message).lower()
                              and "prototype" not in str(x.message) for x in w))
        syncs = f"encode {counts[0]}, apply {counts[1]}"
    return times["enc"], times["app"], syncs


def _why(e: Exception) -> str:
    """A failure in one line: the first line and the last (a worker's error ends its
    traceback)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [""]
    return (lines[0] + (" ... " + lines[-1] if len(lines) > 1 else ""))[:400]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per spawned world")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows = []
    for name, run in (("train", lambda: check_train(a.device, a.timeout)),
                      ("w1", lambda: [check_w1(a.device, a.timeout)]),
                      ("hf_load", lambda: [check_hf_load(a.device, a.timeout)]),
                      ("quant", lambda: check_quant(a.device)),
                      ("codecs", lambda: check_codecs(a.device)),
                      ("qwd", lambda: [check_qwd(a.device)])):
        try:
            rows += run()
        except Exception as e:  # noqa: BLE001 - a failed check is a row, the others still run
            rows.append({"check": name, "ok": False, "seconds": 0.0,
                         "measured": f"{type(e).__name__}: {_why(e)}"})
    dev = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"## gpu_check on {dev} (torch {torch.__version__}), "
          f"{time.perf_counter() - t0:.0f} s\n")
    print("| check | ok | measured | s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['check']} | {'ok' if r['ok'] else 'FAILED'} | {r['measured']} | "
              f"{r['seconds']:.2f} |")
    print("\n| preset | master | grads | optimizer | secondaries | error fb | gathered peak "
          "| device peak |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "memory" in r:
            m = r["memory"]
            print(f"| {r['check'][6:]} | {m['master_shards']} | {m['gradient_shards']} | "
                  f"{m['optimizer_state']} | {m['secondary_shards']} | {m['error_feedback']} | "
                  f"{m['gathered_peak']} | {r['peak']} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": dev, "rows": rows}, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
