"""Rank 0 of Hugging Face's ZeRO-3 load reads each checkpoint tensor when it is copied
into its parameter, not the whole checkpoint first.

[Note: why, and the one function replaced]
transformers 5's `from_pretrained` under ZeRO-3 merges every checkpoint file into one
state dict on rank 0 (`load_state_dict(file, map_location="cpu")` per file, in
modeling_utils; the other ranks get meta tensors) and only then writes the model
module by module inside `GatheredParameters(modifier_rank=0)`. So rank 0 holds the
whole checkpoint, at any ZeRO-3 backend: 5.6 GB for a 1.1B model in 5 files of at most
944 MB (benchmarks/RESULTS.md, "from_pretrained under ZeRO-3"). With zeropp's
`zero.Init` entered (transformers enters it first, before the load), `install`
replaces that module's `load_state_dict` with one that, for a safetensors file on
the CPU, returns `Lazy` tensors: each has the checkpoint tensor's shape and dtype
and reads its bytes from the file at every use (the `copy_` into the parameter, a
conversion's op), keeping none. Every other call goes to transformers' own function.
tests/deepspeed/test_hf_zero3_load.py pins the function's signature and checks the
values loaded bit for bit.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch
from torch.utils._pytree import tree_map


class Lazy(torch.Tensor):
    """A checkpoint tensor read from its safetensors file at each use, not kept."""

    @staticmethod
    def __new__(cls, path: str, key: str, shape: list, dtype: torch.dtype) -> Lazy:
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="cpu")
        t.path, t.key = path, key
        return t

    def read(self) -> torch.Tensor:
        from safetensors import safe_open
        with safe_open(self.path, framework="pt") as f:
            return f.get_tensor(self.key)

    def __repr__(self) -> str:
        return f"Lazy({self.key!r} of {self.path}, {tuple(self.shape)}, {self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: Any = None) -> Any:
        read = lambda x: x.read() if isinstance(x, Lazy) else x  # noqa: E731
        return func(*tree_map(read, args), **tree_map(read, kwargs or {}))


def _lazy_state_dict(path: str, dtypes: dict) -> dict | None:
    """`Lazy` tensors for the safetensors file at `path`; `dtypes`: transformers' own
    table of safetensors dtype names (modeling_utils.str_to_torch_dtype)."""
    from safetensors import safe_open
    out = {}
    with safe_open(path, framework="pt") as f:
        for k in f.keys():
            s = f.get_slice(k)
            dtype = dtypes.get(s.get_dtype())
            if dtype is None:
                return None  # a dtype it does not know: transformers' own reading
            out[k] = Lazy(path, k, s.get_shape(), dtype)
    return out


def install() -> None:
    """Replace transformers' `modeling_utils.load_state_dict` (see the note); once, and
    only for the signature it was written against (else transformers' stays)."""
    mu = sys.modules.get("transformers.modeling_utils")
    own = getattr(mu, "load_state_dict", None)
    dtypes = getattr(mu, "str_to_torch_dtype", None)
    if (own is None or getattr(own, "_zeropp", False) or not signature_known(own)
            or not isinstance(dtypes, dict)):
        return

    @functools.wraps(own)
    def load_state_dict(checkpoint_file: Any, map_location: Any = "cpu", *args: Any,
                        **kwargs: Any) -> dict:
        from transformers.integrations import is_deepspeed_zero3_enabled
        if (str(map_location) == "cpu" and str(checkpoint_file).endswith(".safetensors")
                and is_deepspeed_zero3_enabled()):
            lazy = _lazy_state_dict(str(checkpoint_file), dtypes)
            if lazy is not None:
                return lazy
        return own(checkpoint_file, map_location, *args, **kwargs)
    load_state_dict._zeropp = True
    mu.load_state_dict = load_state_dict


def signature_known(fn: Any) -> bool:
    """transformers 5's `load_state_dict(checkpoint_file, map_location="cpu",
    weights_only=True, disable_mmap=None)`."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return names[:2] == ["checkpoint_file", "map_location"]
