"""`model.state_dict()` / `load_state_dict()` after shard(): the model's own names.

[Note: state dicts of a sharded model]
`shard()` takes a unit's parameters out of their modules and registers the unit's flat master
shards as `_zeropp_flatK` (what `parameters()` yields and optimizers step). The state dict keeps
the model's own keys, in its own order, through hooks on every module that held a parameter:
- Inside a gather (`zeropp.gathered(model)`, DeepSpeed's `GatheredParameters`, or the unit's own
  forward) a name maps to a copy of the full weights the module computes with (compute dtype;
  INT8 values under qwZ). A copy: the gathered buffer is freed on exit, and a state dict usually
  outlives the context. With `keep_vars=True`, the module attribute itself.
- Outside a gather a name maps to an empty placeholder (`numel() == 0`, its `ds_shape` the
  parameter's shape), as DeepSpeed ZeRO-3's `module.state_dict()` gives. The alternatives are
  worse: this rank's piece of a flat shard means nothing to any reader; gathering in full makes
  `state_dict()` a collective, which the common `if rank == 0: torch.save(model.state_dict())`
  turns into a hang (FSDP1's trap); refusing breaks libraries that only read keys (transformers,
  PEFT). Loading a placeholder fails, naming the key and `zeropp.full_state_dict` (fp32 masters).
- `load_state_dict(sd)` of full tensors under the original names, outside a gather, on every
  rank: each rank copies its own slice into its master shard (no collective) and drops the hpZ
  secondaries / qWD copies of the units it touched, so their next gathers are full ones on
  every rank alike. Inside a gather the values go into the gathered weights and the context's
  exit decides: written into every shard with `writable` / `modifier_rank` (rank 0 alone may
  load under `GatheredParameters(modifier_rank=0)`), else discarded, as DeepSpeed does.
Errors are torch's (`strict`'s missing and unexpected keys, size mismatches), raised where they
happen; one rank's error in a writable gather is raised on every rank at exit (gathered.py).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
from torch import nn

from . import master_shard
from .flat_param import FlatParam

FLAT_PREFIX = "_zeropp_flat"


def install(units: list, order: dict[nn.Module, list[str]]) -> None:
    """Hook every unit module and every module that held a sharded parameter. `order`: each
    such module's parameter names as they were before shard()."""
    owned: dict[nn.Module, list[tuple[str, FlatParam, int]]] = {u.module: [] for u in units}
    for u in units:
        for f in u.flats:
            for i, info in enumerate(f.infos):
                for mod, attr in info.registrations:
                    owned.setdefault(mod, []).append((attr, f, i))
    unit_modules = {u.module for u in units}
    for mod, entries in owned.items():
        rank = {name: k for k, name in enumerate(order.get(mod, []))}
        entries.sort(key=lambda e: rank.get(e[0], len(rank)))
        mod._zeropp_params = entries  # its parameters in order (for a front door that lists them)
        keep_vars: dict[str, bool] = {}
        mod.register_state_dict_pre_hook(functools.partial(_note_keep_vars, keep_vars))
        mod.register_state_dict_post_hook(functools.partial(_save, entries, keep_vars))
        mod._register_load_state_dict_pre_hook(functools.partial(_load, entries), with_module=True)
        if mod in unit_modules:
            mod.register_load_state_dict_post_hook(_forget_flat_keys)


def _note_keep_vars(keep_vars: dict, module: nn.Module, prefix: str, keep: bool) -> None:
    keep_vars[prefix] = keep


def _save(entries: list, keep_vars: dict, module: nn.Module, sd: dict, prefix: str,
          local_metadata: Any) -> None:
    keep = keep_vars.pop(prefix, False)
    # This module's keys (flat shards, buffers, children's) are the dict's last: taken out,
    # then put back after the parameters, as an unsharded module writes them.
    mine = list(itertools.takewhile(lambda k: k.startswith(prefix), reversed(sd)))
    rest = {k: sd.pop(k) for k in reversed(mine)}
    for attr, f, i in entries:
        sd[prefix + attr] = _value(f, i, keep)
    sd.update((k, v) for k, v in rest.items() if not k[len(prefix):].startswith(FLAT_PREFIX))


def _value(f: FlatParam, i: int, keep_vars: bool) -> torch.Tensor:
    t = f.params[i]
    if f.gathered:
        return t if keep_vars else t.detach().clone()
    placeholder = torch.empty(0, dtype=f.compute_dtype, device=t.device)
    if f.hooks is not None:
        f.hooks.on_tensor(placeholder, f, f.infos[i], "placeholder")
    return placeholder


def _load(entries: list, module: nn.Module, sd: dict, prefix: str, local_metadata: Any,
          strict: bool, missing: list, unexpected: list, errors: list) -> None:
    for k in [k for k in sd if k.startswith(prefix + FLAT_PREFIX) and "." not in k[len(prefix):]]:
        del sd[k]
        errors.append(f"{k!r} is a zeropp flat shard (a state dict of an older zeropp): load "
                      "one under the model's own names (zeropp.full_state_dict), or use "
                      "zeropp.load_checkpoint")
    touched: set[FlatParam] = set()
    for attr, f, i in entries:
        key = prefix + attr
        if key not in sd:
            if strict:
                missing.append(key)
            continue
        v, info = sd.pop(key), f.infos[i]
        if not isinstance(v, torch.Tensor):
            errors.append(f'While copying the parameter named "{key}", expected torch.Tensor '
                          f"in the state dict, got {type(v).__name__}.")
        elif v.numel() == 0 and info.numel:
            errors.append(f"{key!r} is an empty placeholder: a state_dict() taken outside a "
                          "gather (as under DeepSpeed ZeRO-3). Take it inside "
                          "zeropp.gathered(model), or use zeropp.full_state_dict(model)")
        elif v.shape != info.shape:
            errors.append(f"size mismatch for {key}: copying a param with shape {v.shape} "
                          f"from checkpoint, the shape in current model is {info.shape}.")
        else:
            with torch.no_grad():
                if f.gathered and (f.unit.pins or not f.persistent):
                    f.params[i].copy_(v)  # the gathered weights; the context's exit decides
                else:
                    master_shard.write_param(f, i, v)
                    touched.add(f)
    for f in touched:
        f.buffer.invalidate()
    if touched:  # (every rank loads the same keys)
        next(iter(touched)).unit.state.regather_resident(list(touched))


def _forget_flat_keys(module: nn.Module, incompatible: Any) -> None:
    # A unit's flat shards are never in a state dict: not missing.
    missing = incompatible.missing_keys
    missing[:] = [k for k in missing if not k.rsplit(".", 1)[-1].startswith(FLAT_PREFIX)]
