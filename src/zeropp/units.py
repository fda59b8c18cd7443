"""Which modules of a model become units (gathered and freed together), and which
unit owns each parameter: the choices `shard()` makes before it flattens anything."""

from __future__ import annotations

from typing import Optional

from torch import nn


def unit_modules(model: nn.Module, unit_types: Optional[tuple]) -> dict[nn.Module, str]:
    """Unit module -> name ("" for the root), in module order. Automatic units: a transformers
    model's decoder layers (the classes its `_no_split_modules` names) and its input embedding
    when the head does not share it, else the entries of every nn.ModuleList."""
    units = {model: ""}
    if unit_types is None:
        units.update(_untied_embeddings(model))
        names = {c for m in model.modules() for c in (getattr(m, "_no_split_modules", None) or ())}
        unit_types = tuple({type(m) for m in model.modules() if type(m).__name__ in names}) or None
    for name, m in model.named_modules():
        if m is model or m in units:
            continue
        if unit_types is not None:
            if isinstance(m, unit_types):
                units[m] = name
        elif isinstance(m, nn.ModuleList):
            for i, child in enumerate(m):
                if child not in units and any(True for _ in child.parameters()):
                    units[child] = f"{name}.{i}"
    return _leaf_units(model, units)


def _leaf_units(model: nn.Module, units: dict[nn.Module, str]) -> dict[nn.Module, str]:
    """A module flagged as a ZeRO-3 leaf (`deepspeed.utils.set_z3_leaf_modules`: a MoE
    block whose experts run in any order, or not at all on some rank) is one unit, and
    nothing inside it is: it is gathered and reduced whole, on every rank alike."""
    if getattr(model, "_z3_leaf", False):
        return {model: ""}  # the whole model is one leaf: one unit
    leaves = [m for m in model.modules() if m is not model and getattr(m, "_z3_leaf", False)]
    if not leaves:
        return units
    inside = {id(x) for leaf in leaves for x in leaf.modules() if x is not leaf}
    # A container is never called, so it cannot gather: its parameters go to the unit
    # around it, which holds them whole all the same.
    containers = {id(m) for m in leaves if isinstance(m, (nn.ModuleList, nn.ModuleDict))}
    keep = {id(m) for m in units} | {id(m) for m in leaves if id(m) not in containers}
    return {m: name for name, m in model.named_modules()
            if id(m) in keep and id(m) not in inside and (m is model or name)}


def _untied_embeddings(model: nn.Module) -> dict[nn.Module, str]:
    """A transformers model's input embedding is a unit of its own when the output head does not
    share its weight: gathered only around the lookup (not for backward: unit_hooks.Unit) instead of
    the whole step as part of the root (a 32k x 2048 vocabulary: 262 MB at fp32). The head stays in
    the root: fused losses (TRL's, Liger's) read `lm_head.weight` without calling lm_head."""
    try:
        inp = model.get_input_embeddings() if callable(
            getattr(model, "get_input_embeddings", None)) else None
        out = model.get_output_embeddings() if callable(
            getattr(model, "get_output_embeddings", None)) else None
    except (NotImplementedError, AttributeError):
        return {}
    if not isinstance(inp, nn.Module) or inp is model:
        return {}
    if isinstance(out, nn.Module) and {id(p) for p in inp.parameters()} & {
            id(p) for p in out.parameters()}:
        return {}  # tied: the weight serves both ends, it stays in the root
    name = next((n for n, m in model.named_modules() if m is inp), None)
    return {inp: name} if name else {}


def assign_params(model: nn.Module, units: dict[nn.Module, str]) -> dict[nn.Module, list]:
    """Each parameter goes to the innermost unit holding it; a parameter held by several units
    (tied weights across units) goes to the root, which is gathered whenever any unit runs."""
    regs: dict[nn.Parameter, list] = {}

    def walk(mod: nn.Module, prefix: str, unit: nn.Module) -> None:
        unit = mod if mod in units else unit
        for name, p in mod._parameters.items():
            if p is not None:
                regs.setdefault(p, []).append((mod, name, prefix + name, unit))
        for cname, child in mod._modules.items():
            if child is not None:
                walk(child, f"{prefix}{cname}.", unit)

    walk(model, "", model)
    owned: dict[nn.Module, list] = {u: [] for u in units}
    for p, rs in regs.items():
        owners = {r[3] for r in rs}
        owner = owners.pop() if len(owners) == 1 else model
        owned[owner].append((p, list(dict.fromkeys((r[0], r[1]) for r in rs)), [r[2] for r in rs]))
    return owned
