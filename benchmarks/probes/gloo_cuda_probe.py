"""Which gloo collectives take CUDA tensors, on this torch: one 2-rank world per
collective, each in its own processes under a timeout (a crash or hang is a row,
not the end of the probe). gpu_check's emulated nodes run gloo over CUDA tensors
on one GPU (NCCL refuses two ranks on one device), so this is what they rely on.

    python benchmarks/probes/gloo_cuda_probe.py [--device cuda|cpu] [--timeout 30]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

OPS = ["all_gather_into_tensor", "all_to_all_single", "scatter", "batch_isend_irecv",
       "all_reduce", "broadcast", "reduce_scatter_tensor"]


def _worker(op: str, device: str) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    x = torch.arange(4, dtype=torch.float32, device=device) + 10 * r
    if op == "all_gather_into_tensor":
        out = torch.empty(4 * w, device=device)
        dist.all_gather_into_tensor(out, x)
        want = torch.cat([torch.arange(4.0) + 10 * i for i in range(w)])
    elif op == "all_to_all_single":
        out = torch.empty(4, device=device)
        dist.all_to_all_single(out, x)
        want = torch.tensor([0.0, 1, 10, 11]) + (2 if r else 0)
    elif op == "scatter":
        out = torch.empty(2, device=device)
        dist.scatter(out, list(x.view(2, 2).unbind(0)) if r == 0 else None, src=0)
        want = torch.arange(2.0) + 2 * r
    elif op == "batch_isend_irecv":
        out = torch.empty(4, device=device)
        ops = [dist.P2POp(dist.isend, x, (r + 1) % w), dist.P2POp(dist.irecv, out, (r - 1) % w)]
        for wk in dist.batch_isend_irecv(ops):
            wk.wait()
        want = torch.arange(4.0) + 10 * ((r - 1) % w)
    elif op == "all_reduce":
        out = x.clone()
        dist.all_reduce(out)
        want = sum(torch.arange(4.0) + 10 * i for i in range(w))
    elif op == "broadcast":
        out = x.clone()
        dist.broadcast(out, src=0)
        want = torch.arange(4.0)
    else:
        out = torch.empty(2, device=device)
        dist.reduce_scatter_tensor(out, x)
        want = sum(torch.arange(4.0) + 10 * i for i in range(w))[2 * r:2 * r + 2]
    assert out.device.type == device and torch.equal(out.cpu(), want), (out, want)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--timeout", type=float, default=30)
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        _worker(*a.worker)
        return 0
    print(f"gloo with {a.device} tensors, torch {torch.__version__}\n\n| op | result |\n|---|---|")
    for i, op in enumerate(OPS):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29611 + i), WORLD_SIZE="2")
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", op, a.device],
                                  env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(2)]
        results = []
        for pr in procs:
            try:
                out, _ = pr.communicate(timeout=a.timeout)
                last = [ln for ln in out.strip().splitlines() if ln.strip()]
                results.append("ok" if pr.returncode == 0 else
                               f"rc {pr.returncode}: {last[-1][:160] if last else ''}")
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                results.append(f"hung > {a.timeout:g} s")
        print(f"| {op} | {'ok' if all(r == 'ok' for r in results) else '; '.join(results)} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
