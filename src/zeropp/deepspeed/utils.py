"""`deepspeed.utils` on zeropp: the logger, `log_dist`, the tensor-fragment API
(tensor_fragment.py), `zero_to_fp32` (zero_to_fp32.py) and the ZeRO-3 leaf-module
flags.

[Note: leaf modules]
DeepSpeed gathers a module flagged "leaf" (`set_z3_leaf_modules`, a MoE block
whose experts run in any order, or not at all on some rank) whole on entry
instead of submodule by submodule. zeropp makes a flagged module one unit when
the model is sharded (units.py): its submodules never become units of their
own, so all of it is gathered and reduced together on every rank, whichever
experts ran. Flags set after sharding change nothing.
"""

from __future__ import annotations

import logging
from typing import Any, Union

from torch import nn

from . import comm as _comm
from .tensor_fragment import (  # noqa: F401 - deepspeed.utils' public names
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)

logger = logging.getLogger("zeropp.deepspeed")
is_initialized = _comm.is_initialized


def log_dist(message: str, ranks: Any = None, level: int = logging.INFO) -> None:
    """DeepSpeed's log_dist: log on the ranks listed ([-1]: all); before the
    process group exists, always."""
    ranks = list(ranks or [])
    show = not _comm.is_initialized() or (bool(ranks) and ranks[0] == -1) \
        or _comm.get_rank() in ranks
    if show:
        logger.log(level, f"[Rank {_comm.get_rank()}] {message}")


# ---- leaf modules (see the note) ------------------------------------------------------
def z3_leaf_module(model: nn.Module) -> bool:
    """Whether `model` is flagged as a leaf module."""
    return bool(getattr(model, "_z3_leaf", False))


def z3_leaf_parameter(param: Any) -> bool:
    """Whether a parameter belongs to a leaf module (DeepSpeed marks them so)."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list:
    """The modules of `model` flagged as leaves."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def _matches(module: nn.Module, spec: Union[type, str]) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    cls = type(module)
    return spec in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _flag_classes(model: nn.Module, classes: Any, flag: bool, raise_if_not_found: bool) -> list:
    classes = list(classes)
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise ValueError(f"leaf_module_classes must be classes or class names, got {bad}")
    found = [m for m in model.modules() if any(_matches(m, c) for c in classes)]
    for m in found:
        m._z3_leaf = flag
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {classes} found in model {type(model).__name__}")
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Any,
                        raise_if_not_found: bool = True) -> list:
    """Flag every module of these classes (classes, names or fully-qualified
    names) as a leaf; returns them."""
    return _flag_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Any,
                          raise_if_not_found: bool = True) -> list:
    """Clear the leaf flag of every module of these classes; returns them."""
    return _flag_classes(model, leaf_module_classes, False, raise_if_not_found)


def _flag_names(model: nn.Module, wanted: list, flag: bool, raise_if_not_found: bool,
                match: Any, what: str) -> tuple[list, list]:
    found, missing, seen = [], [], set()
    named = list(model.named_modules())
    for w in wanted:
        hits = [m for n, m in named if match(n, w)]
        if not hits:
            missing.append(w)
        for m in hits:
            m._z3_leaf = flag
            if id(m) not in seen:
                seen.add(id(m))
                found.append(m)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules {what} {missing} found in model {type(model).__name__}")
    return found, missing


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: list, flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list, list]:
    """Flag the modules named (as in `named_modules()`); returns (modules, missing names)."""
    return _flag_names(model, list(module_names), flag, raise_if_not_found,
                       lambda n, w: n == w, "named")


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: list,
                                  flag: bool = True, raise_if_not_found: bool = True
                                  ) -> tuple[list, list]:
    """Flag the modules whose names end with a suffix; returns (modules, missing suffixes)."""
    return _flag_names(model, list(module_name_suffixes), flag, raise_if_not_found,
                       lambda n, w: n.endswith(w), "matching suffixes")
