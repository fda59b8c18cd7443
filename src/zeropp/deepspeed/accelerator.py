"""`deepspeed.accelerator` on zeropp: `get_accelerator()` returns one object
that answers DeepSpeed scripts' device questions (which device, which
communication backend, which dtypes, seeds, memory, streams) for CUDA or the
CPU, so `get_accelerator().device_name()` and friends run unchanged.

The choice follows DeepSpeed: `DS_ACCELERATOR` ("cuda" or "cpu") if set, else
CUDA when available, else the CPU. zeropp runs gloo on the CPU (DeepSpeed's
CPU accelerator names oneCCL, which zeropp does not need).

[Note: CPU memory figures]
On the CPU there is no allocator to ask, so `memory_allocated` is the process's
resident set (RSS) and `max_memory_allocated` its high-water mark (VmHWM);
`reset_peak_memory_stats` resets the mark through /proc/self/clear_refs (Linux),
so a peak measured after it belongs to what ran after it. These include
everything the process holds (Python, torch's own ~300 MB), not only tensors.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch

_KINDS = ("cuda", "cpu")


def _proc_status_kb(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class _NullStream:
    """What a CPU stream is: work runs in order, so waiting is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _NullEvent()

    def query(self) -> bool:
        return True


class _NullEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        raise RuntimeError("zeropp accelerator (cpu): events carry no timing on the CPU; "
                           "use time.perf_counter()")


class Accelerator:
    """DeepSpeed's accelerator interface for one device kind ("cuda" or "cpu")."""

    def __init__(self, kind: str) -> None:
        if kind not in _KINDS:
            raise ValueError(f"zeropp accelerator: {kind!r} is not supported; allowed: "
                             f"{', '.join(_KINDS)} (set DS_ACCELERATOR to one of them)")
        if kind == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("zeropp accelerator: DS_ACCELERATOR=cuda but CUDA is not "
                               "available on this machine")
        self._name = kind
        self._communication_backend_name = "nccl" if kind == "cuda" else "gloo"
        self._cuda = kind == "cuda"

    def __repr__(self) -> str:
        return f"zeropp Accelerator({self._name})"

    # ---- the device ----------------------------------------------------------------
    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def device_name(self, device_index: Optional[int] = None) -> str:
        if device_index is None or not self._cuda:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index: Optional[int] = None) -> torch.device:
        if not self._cuda:
            return torch.device("cpu")
        return torch.device("cuda", device_index if device_index is not None
                            else torch.cuda.current_device())

    def set_device(self, device_index: Any) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        if self._cuda:
            return torch.cuda.device_count()
        # DeepSpeed's CPU accelerator reads its launcher's LOCAL_SIZE; torchrun sets
        # LOCAL_WORLD_SIZE.
        return int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or "1")

    def synchronize(self, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def is_synchronized_device(self) -> bool:
        return not self._cuda

    def use_host_timers(self) -> bool:
        return not self._cuda

    def resolves_data_dependency(self) -> bool:
        return not self._cuda

    def handles_memory_backpressure(self) -> bool:
        return not self._cuda

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"] if self._cuda else []

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids: list) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._cuda else []

    # ---- dtypes --------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        out = [torch.float32, torch.float16]
        return out + [torch.bfloat16] if self.is_bf16_supported() else out

    def is_triton_supported(self) -> bool:
        return False  # zeropp uses no Triton kernels

    # ---- seeds and RNG ---------------------------------------------------------------
    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed) if not self._cuda else torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed) if not self._cuda else torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def seed(self) -> None:
        torch.cuda.seed() if self._cuda else torch.seed()

    def get_rng_state(self, device_index: Optional[int] = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state(device_index if device_index is not None else "cuda")
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state,
                                     device_index if device_index is not None else "cuda")
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int = 0) -> torch.Generator:
        return torch.cuda.default_generators[device_index] if self._cuda \
            else torch.default_generator

    # ---- streams and events ------------------------------------------------------------
    @property
    def Stream(self) -> Any:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Stream if self._cuda else _NullStream

    @property
    def Event(self) -> Any:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Event if self._cuda else _NullEvent

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: Optional[int] = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._cuda else _NullStream()

    def default_stream(self, device_index: Optional[int] = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._cuda else _NullStream()

    def range_push(self, msg: str) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Any) -> None:
        torch.cuda._lazy_call(callback) if self._cuda else callback()

    def amp(self) -> Any:
        return torch.amp

    # ---- memory (see the note for the CPU) ----------------------------------------------
    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        if self._cuda:
            return torch.cuda.memory_allocated(device_index)
        return _proc_status_kb("VmRSS") * 1024

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        return _proc_status_kb("VmHWM") * 1024

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
            return
        with contextlib.suppress(OSError):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS

    reset_max_memory_allocated = reset_peak_memory_stats

    def memory_reserved(self, device_index: Optional[int] = None) -> int:
        return (torch.cuda.memory_reserved(device_index) if self._cuda
                else self.memory_allocated())

    def max_memory_reserved(self, device_index: Optional[int] = None) -> int:
        return (torch.cuda.max_memory_reserved(device_index) if self._cuda
                else self.max_memory_allocated())

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def reset_max_memory_cached(self, device_index: Optional[int] = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: Optional[int] = None) -> dict:
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        return {"allocated_bytes.all.current": self.memory_allocated(),
                "allocated_bytes.all.peak": self.max_memory_allocated()}

    def total_memory(self, device_index: Optional[int] = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: Optional[int] = None) -> int:
        if self._cuda:
            free, _ = torch.cuda.mem_get_info(device_index)
            return free
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    # ---- tensors -------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    def _tensor_type(self, dtype: torch.dtype) -> Any:
        """torch.cuda.FloatTensor-style constructors: sizes give an empty tensor,
        data a tensor of it."""
        dev = self._name

        def make(*args: Any) -> torch.Tensor:
            if all(isinstance(a, int) for a in args):
                return torch.empty(args, dtype=dtype, device=dev)
            return torch.tensor(args[0], dtype=dtype, device=dev)
        return make

    @property
    def FloatTensor(self) -> Any:  # noqa: N802
        return self._tensor_type(torch.float32)

    @property
    def HalfTensor(self) -> Any:  # noqa: N802
        return self._tensor_type(torch.float16)

    @property
    def BFloat16Tensor(self) -> Any:  # noqa: N802
        return self._tensor_type(torch.bfloat16)

    @property
    def LongTensor(self) -> Any:  # noqa: N802
        return self._tensor_type(torch.int64)

    @property
    def IntTensor(self) -> Any:  # noqa: N802
        return self._tensor_type(torch.int32)

    @property
    def ByteTensor(self) -> Any:  # noqa: N802
        return self._tensor_type(torch.uint8)

    # ---- DeepSpeed's kernel builders: zeropp has none ---------------------------------
    def op_builder_dir(self) -> str:
        return "zeropp.ops"

    def create_op_builder(self, class_name: str) -> Any:
        return None  # DeepSpeed's answer for an op this accelerator lacks

    def get_op_builder(self, class_name: str) -> Any:
        return None

    def build_extension(self) -> Any:
        raise RuntimeError("zeropp accelerator: DeepSpeed's C++/CUDA op builders are not part "
                           "of zeropp; it needs no compiled kernels")

    def get_compile_backend(self) -> str:
        return "inductor"

    def set_compile_backend(self, backend: str) -> None:
        if backend != "inductor":
            raise ValueError(f"zeropp accelerator: compile backend {backend!r} is not "
                             "supported; allowed: 'inductor'")


_accelerator: Optional[Accelerator] = None


def get_accelerator() -> Accelerator:
    """The process's accelerator (chosen once; see the module docstring)."""
    global _accelerator
    if _accelerator is None:
        kind = os.environ.get("DS_ACCELERATOR")
        if kind is None:
            kind = "cuda" if torch.cuda.is_available() else "cpu"
        _accelerator = Accelerator(kind.lower())
    return _accelerator


def set_accelerator(accel_obj: Accelerator) -> None:
    global _accelerator
    if not isinstance(accel_obj, Accelerator):
        raise ValueError("zeropp set_accelerator: pass an accelerator made by zeropp "
                         "(zeropp.accelerator.Accelerator('cuda' | 'cpu'))")
    _accelerator = accel_obj


def is_current_accelerator_supported() -> bool:
    return get_accelerator()._name in _KINDS

