"""`engine.module.named_parameters()` under DeepSpeed's contract: the model's own
parameters, by their own names.

zeropp's contract (`zeropp.shard`) is that `parameters()` yields the flat fp32
master shards, which the user's optimizer steps. Under `deepspeed.initialize`
the engine builds the optimizer, and code written for DeepSpeed walks
`engine.module.named_parameters()` expecting the model's names and, for each,
a tensor it can pass to `GatheredParameters` or the `safe_get_full_*` API, read
`ds_status` / `ds_shape` from, and see in full while its unit is gathered
(0 elements otherwise, as DeepSpeed's). Those are exactly the module attributes
zeropp keeps (FlatParam.params), so under the engine `named_parameters()` and
`parameters()` of every module of the model (and of the engine, as
`module.<name>`) yield them, in the model's own order, tied ones once. The
master shards stay what the engine's optimizer holds (`engine.optimizer`) and
what zeropp's own functions use (`get_state(model).flats`).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..shard import get_state
from ..state_dict import FLAT_PREFIX


def expose_original_parameters(model: nn.Module, owner: Any = None) -> None:
    """Every module of the sharded `model` (and `owner`, the engine holding it as
    `module`) yields the original parameters from `named_parameters()`."""
    get_state(model)  # sharded, or a clear error
    for m in model.modules():
        m.named_parameters = types.MethodType(_named_parameters, m)
    if owner is not None:
        owner.named_parameters = types.MethodType(_named_parameters, owner)


def _own(m: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A module's own parameters: its original ones (state_dict.install recorded
    them in order) and any zeropp left registered, never a master shard."""
    for attr, f, i in getattr(m, "_zeropp_params", ()):
        yield attr, f.params[i]
    for name, p in m._parameters.items():
        if p is not None and not name.startswith(FLAT_PREFIX):
            yield name, p


def _named_parameters(self: nn.Module, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    mods = self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) if recurse \
        else [(prefix, self)]
    seen: set[int] = set()
    for mprefix, m in mods:
        for name, t in _own(m):
            if remove_duplicate:
                if id(t) in seen:
                    continue
                seen.add(id(t))
            yield (f"{mprefix}.{name}" if mprefix else name), t


def master_shards(model: nn.Module) -> list[torch.Tensor]:
    """The flat fp32 master shards of a sharded model (what zeropp's optimizer steps)."""
    return [f.primary_shard for f in get_state(model).flats]
