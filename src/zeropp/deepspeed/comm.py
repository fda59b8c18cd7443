"""`deepspeed.comm` on zeropp: DeepSpeed's communication module, thin over
torch.distributed (which is what DeepSpeed's own is on its torch backend), so
scripts' `dist = deepspeed.comm; dist.get_rank(); dist.barrier()` run
unchanged. `init_distributed` is the front door's (gloo on the CPU, NCCL with
CUDA). `ReduceOp` is torch's, so the two can be mixed. DeepSpeed's profiling
keywords (`prof`, `log_name`, `debug`) are accepted everywhere and ignored; a name
of DeepSpeed's module not here is an AttributeError saying so.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

__all__ = ["init_distributed", "is_initialized", "is_available", "get_rank", "get_world_size",
           "get_local_rank", "get_global_rank", "get_world_group", "get_backend", "new_group",
           "barrier", "monitored_barrier", "all_reduce", "inference_all_reduce", "broadcast",
           "all_gather", "all_gather_into_tensor", "allgather_fn", "reduce", "reduce_scatter",
           "reduce_scatter_tensor", "reduce_scatter_fn", "all_to_all_single", "gather",
           "scatter", "send", "recv", "isend", "irecv", "destroy_process_group", "ReduceOp",
           "configure", "log_summary", "broadcast_object_list", "all_gather_object",
           "all_to_all", "all_reduce_coalesced", "all_gather_coalesced",
           "get_all_ranks_from_group", "has_all_gather_into_tensor",
           "has_reduce_scatter_tensor", "has_all_reduce_coalesced", "has_coalescing_manager"]


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: Optional[timedelta] = None, init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config: Any = None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Initialize torch.distributed from the launcher's environment (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT), from `init_method` with `rank` and
    `world_size` when given (DeepSpeed's own test launcher: file://), or as one
    process when there is none; a no-op when already initialized. Backend: NCCL
    with CUDA, else gloo."""
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("zeropp.init_distributed: dist_init_required=False but "
                           "torch.distributed is not initialized")
    explicit = rank >= 0 and world_size > 0
    if not explicit and ("RANK" not in os.environ or "WORLD_SIZE" not in os.environ):
        if rank > 0 or world_size > 1:
            raise RuntimeError("zeropp.init_distributed: no launcher environment (RANK, "
                               "WORLD_SIZE) and not both rank= and world_size=; start with "
                               "torchrun or `zeropp launch`")
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    if explicit:  # what the rest of zeropp reads (topology, devices), as a launcher sets it
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
        os.environ.setdefault("LOCAL_RANK", str(rank))
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    where = {"rank": rank, "world_size": world_size} if explicit else {}
    dist.init_process_group(backend, init_method=init_method,
                            timeout=timeout or timedelta(minutes=10), **where)



def _need() -> None:
    if not dist.is_initialized():
        raise RuntimeError("zeropp comm: torch.distributed is not initialized; call "
                           "deepspeed.init_distributed() (or deepspeed.initialize) first")


def is_initialized() -> bool:
    return dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group: Any = None) -> int:
    """This process's rank (0 before initialization, as DeepSpeed's scripts expect
    of a single process)."""
    return dist.get_rank(group) if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def get_world_size(group: Any = None) -> int:
    return (dist.get_world_size(group) if dist.is_initialized()
            else int(os.environ.get("WORLD_SIZE", "1")))


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    _need()
    return dist.get_global_rank(group or dist.group.WORLD, group_rank)


def get_world_group() -> Any:
    _need()
    return dist.group.WORLD


def get_backend(group: Any = None) -> str:
    _need()
    return dist.get_backend(group)


def new_group(ranks: Optional[list[int]] = None, **kwargs: Any) -> Any:
    _need()
    return dist.new_group(ranks, **kwargs)


def destroy_process_group(group: Any = None) -> None:
    if dist.is_initialized():
        dist.destroy_process_group(group)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None,
            **kwargs: Any) -> Any:
    _need()
    return dist.barrier(group=group, async_op=async_op)


def monitored_barrier(group: Any = None, timeout: Any = None,
                      wait_all_ranks: bool = False, **kwargs: Any) -> Any:
    _need()
    if dist.get_backend(group) == "gloo":
        return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)
    return dist.barrier(group=group)  # only gloo implements the monitored one


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
               async_op: bool = False, prof: bool = False, log_name: str = "all_reduce",
               debug: Any = None) -> Any:
    _need()
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
                         **kwargs: Any) -> Any:
    return all_reduce(tensor, op=op, group=group)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False,
              **kwargs: Any) -> Any:
    _need()
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False, **kwargs: Any) -> Any:
    _need()
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False, **kwargs: Any) -> Any:
    _need()
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                 async_op: bool = False, debug: Any = None) -> Any:
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None,
           async_op: bool = False, **kwargs: Any) -> Any:
    _need()
    return dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM,
                   group: Any = None, async_op: bool = False, **kwargs: Any) -> Any:
    _need()
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor,
                          op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
                          **kwargs: Any) -> Any:
    _need()
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group,
                                      async_op=async_op)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                      group: Any = None, async_op: bool = False, **kwargs: Any) -> Any:
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor,
                      output_split_sizes: Optional[list[int]] = None,
                      input_split_sizes: Optional[list[int]] = None, group: Any = None,
                      async_op: bool = False, **kwargs: Any) -> Any:
    _need()
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes,
                                  group=group, async_op=async_op)


def gather(tensor: torch.Tensor, gather_list: Optional[list[torch.Tensor]] = None, dst: int = 0,
           group: Any = None, async_op: bool = False, **kwargs: Any) -> Any:
    _need()
    return dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: Optional[list[torch.Tensor]] = None, src: int = 0,
            group: Any = None, async_op: bool = False, **kwargs: Any) -> Any:
    _need()
    return dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **kwargs: Any) -> Any:
    _need()
    return dist.send(tensor, dst=dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: Optional[int] = None, group: Any = None, tag: int = 0,
         **kwargs: Any) -> Any:
    _need()
    return dist.recv(tensor, src=src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **kwargs: Any) -> Any:
    _need()
    return dist.isend(tensor, dst=dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group: Any = None, tag: int = 0,
          **kwargs: Any) -> Any:
    _need()
    return dist.irecv(tensor, src=src, group=group, tag=tag)


def broadcast_object_list(object_list: list, src: int, group: Any = None,
                          device: Any = None) -> None:
    _need()
    dist.broadcast_object_list(object_list, src=src, group=group, device=device)


def all_gather_object(object_list: list, obj: Any, group: Any = None, **kwargs: Any) -> None:
    _need()
    dist.all_gather_object(object_list, obj, group=group)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: Any = None, async_op: bool = False, **kwargs: Any) -> Any:
    _need()
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group,
                           async_op=async_op)


class _Works:
    """Several collectives' works as one (what DeepSpeed's coalesced calls return)."""

    def __init__(self, works: list) -> None:
        self.works = [w for w in works if w is not None]

    def wait(self, timeout: Any = None) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def all_reduce_coalesced(tensors: list[torch.Tensor], op: Any = ReduceOp.SUM, group: Any = None,
                         async_op: bool = False, **kwargs: Any) -> Any:
    """Each tensor all-reduced in place (one collective each)."""
    _need()
    works = _Works([dist.all_reduce(t, op=op, group=group, async_op=async_op) for t in tensors])
    return works if async_op else None


def all_gather_coalesced(output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                         group: Any = None, async_op: bool = False) -> Any:
    """`all_gather_into_tensor` for each (output, input) pair."""
    _need()
    return _Works([dist.all_gather_into_tensor(o, i, group=group, async_op=async_op)
                   for o, i in zip(output_tensors, input_tensors)])


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    _need()
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    return True


def has_coalescing_manager() -> bool:
    """False: callers take their one-collective-per-tensor path."""
    return False


def __getattr__(name: str) -> Any:
    raise AttributeError(f"zeropp: deepspeed.comm.{name} is not provided by zeropp's "
                         "deepspeed.comm (torch.distributed has the collectives)")


def configure(deepspeed_config: Any = None, enabled: Any = None, prof_all: Any = None,
              prof_ops: Any = None, verbose: Any = None, debug: Any = None) -> None:
    """DeepSpeed's comms logger switch: accepted; zeropp's own byte accounting is
    `zeropp.comm_stats(model)`."""


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Any:
    """DeepSpeed prints its comms log here; zeropp points at its accounting."""
    msg = "zeropp: per-collective byte counts are in zeropp.comm_stats(engine.module)"
    if return_dict:
        return {}
    if get_rank() == 0:
        print(msg, flush=True)
    return None
