"""Checkpoints of a sharded model: save and load (resharding to any world size), and the
consolidated state dict. On-disk format and verification: checkpoint_files.py (export: cli/).

[Note: atomic saves]
Every rank writes and fsyncs its file in `.NAME.partial`; rank 0 then writes the manifest (every
file's sha256), fsyncs, and renames the directory into place (a previous checkpoint moved to
`.NAME.old` first, deleted after; anything else at NAME is refused). A save dying at any point
leaves the previous checkpoint: NAME is untouched before the rename, and `load_checkpoint(NAME)`
finds `.NAME.old` between the two. One rank's failure (disk full) is every rank's error, no hang.

[Note: what a load restores]
Master shards (resharded if the world size or layout differs), optimizer state (sharded tensors
resharded; hyper-parameters and step counts as saved), buffers, each rank's RNG states (torch,
CUDA, Python, NumPy; same world size only: ranks do not map otherwise), and save's extras, each
rank its own (at another world size, rank 0's JSON and state-dict extras, no per-rank tensors).
All is read and checked, and the objects passed to restore restored, on every rank before the
model is touched (put back if any rank fails): a failed load changes nothing. hpZ secondaries and
gathered weights are dropped (DeepSpeed #7130, #7606): the next gather reads the loaded masters.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from copy import deepcopy
from functools import partial
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from .checkpoint_files import (
    FORMAT,
    MANIFEST,
    VERSION,
    CheckpointError,
    Reader,
    fsync_dir,
    jsonable,
    param_index,
    rank_file,
    read_json,
    read_manifest,
    replaceable,
    resolve,
    write_durably,
    write_safetensors,
)
from .collectives import Comm
from .config import SCHEDULE_ONLY, Config
from .flat_param import FlatParam
from .guards import agree, all_gather_bytes
from .quant import dequantize_pieces, quantize
from .shard import ShardState, get_state


def full_state_dict(model: nn.Module, *, all_ranks: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded model's state dict (original names, fp32 parameters, buffers as they
    are), from the master shards with one all-gather per flat parameter. Collective. Returned
    on rank 0 (on every rank with `all_ranks=True`); others get {}."""
    st = get_state(model)
    st.comm.unit = "<all: full_state_dict>"
    out: dict[str, torch.Tensor] = {}
    keep = all_ranks or st.topo.rank == 0
    for f in st.flats:
        full = gather_master(f, st.comm)  # every rank takes part in every gather
        if keep:  # the others hold one flat's full weights at a time, never the model
            out.update({k: v.clone() for k, v in unflatten(f, full).items()})
        del full
    if keep:
        out.update({name: buf.detach().clone() for name, buf in _buffers(model).items()})
    return out


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers (those a state dict carries), by name."""
    return {f"{mname}.{bname}" if mname else bname: b for mname, m in model.named_modules()
            for bname, b in m._buffers.items()
            if b is not None and bname not in m._non_persistent_buffers_set}


def _hf_model(model: nn.Module) -> Optional[dict]:
    """The transformers model inside `model` (or `model` itself), if any."""
    for name, m in model.named_modules():
        cfg = getattr(m, "config", None)
        if hasattr(m, "save_pretrained") and hasattr(cfg, "to_json_string"):
            return {"prefix": f"{name}." if name else "", "class": type(m).__name__,
                    "config": json.loads(cfg.to_json_string())}
    return None


# ---- save ---------------------------------------------------------------------------
def save_checkpoint(path: os.PathLike, model: nn.Module,
                    optimizer: Optional[torch.optim.Optimizer] = None, **extra: Any) -> Path:
    """Save a sharded checkpoint to the directory `path` (collective). `extra`: anything else
    to keep, returned by `load_checkpoint` (JSON values, tensors, torch.Generators, objects with
    state_dict() such as an LR scheduler), each rank's own as DeepSpeed ZeRO-3's client_state."""
    st = get_state(model)
    rank, path = st.topo.rank, Path(path)
    tmp, old = path.parent / f".{path.name}.partial", path.parent / f".{path.name}.old"
    err = None
    if rank == 0:
        try:
            replaceable(path)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that died
            tmp.mkdir(parents=True)
        except (OSError, CheckpointError) as e:
            err = f"saving {path}: {e}"
    agree(err, CheckpointError, "checkpoint")  # also a barrier: the directory exists for everyone
    try:  # (on a failure here, the next agree raises before `info` or `manifest` is used)
        tensors, meta, manifest = _collect(st, model, optimizer, extra)
        sha, nbytes = write_safetensors(tmp / rank_file(rank), tensors,
                                        {"zeropp": json.dumps(meta)})
        info = json.dumps({"sha256": sha, "bytes": nbytes})
    except Exception as e:  # noqa: BLE001 - every failure must reach every rank
        err = f"saving {path}: {e}"
    agree(err, CheckpointError, "checkpoint")
    files = [json.loads(b) for b in all_gather_bytes(info.encode(), "checkpoint")]
    if rank == 0:
        try:
            manifest["files"] = {rank_file(r): f for r, f in enumerate(files)}
            write_durably(tmp / MANIFEST, [json.dumps(manifest, indent=1).encode()])
            fsync_dir(tmp)
            _move_into_place(tmp, path, old)
        except Exception as e:  # noqa: BLE001
            err = f"saving {path}: {e}"
    agree(err, CheckpointError, "checkpoint")  # nobody returns before the checkpoint is in place
    return path


def _move_into_place(tmp: Path, path: Path, old: Path) -> None:
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def _collect(st: ShardState, model: nn.Module, opt: Optional[torch.optim.Optimizer],
             extra: dict) -> tuple[dict, dict, dict]:
    """This rank's tensors and file metadata, and the manifest (used on rank 0)."""
    rank = st.topo.rank
    tensors: dict[str, torch.Tensor] = {}
    # Written before anything can change them, so shards and optimizer state are not copied
    # first; buffers and user tensors are, as they may share storage.
    for f in st.flats:
        tensors[f"model/{f.name}"] = f.primary_shard.detach().cpu()
        tensors.update({f"engine/{f.name}/{k}": v for k, v in f.buffer.state().items()})
    buffers = _buffers(model)
    if rank == 0:
        for name, b in buffers.items():
            tensors[f"buffer/{name}"] = b.detach().cpu().contiguous().clone()
    tensors["rng/torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    npy = np.random.get_state()
    meta = {"rank": rank, "python_rng": random.getstate(),  # JSON writes its tuples as lists
            "numpy_rng": [npy[0], npy[1].tolist(), int(npy[2]), int(npy[3]), float(npy[4])]}
    kinds, values = {}, {}
    for k, v in extra.items():
        if isinstance(v, torch.Tensor):
            tensors[f"extra/{k}"], kinds[k] = v.detach().cpu().contiguous().clone(), "tensor"
        elif isinstance(v, torch.Generator):
            tensors[f"extra/{k}"], kinds[k] = v.get_state(), f"generator:{v.device}"
        elif hasattr(v, "state_dict") and hasattr(v, "load_state_dict"):
            values[k], kinds[k] = jsonable(v.state_dict(), f"extra {k!r}"), "stateful"
        else:
            values[k], kinds[k] = jsonable(v, f"extra {k!r}"), "json"
    meta["extra"], meta["extra_kinds"] = values, kinds  # this rank's; the manifest: rank 0's
    manifest = {
        "format": FORMAT, "version": VERSION, "world_size": st.topo.world_size,
        "node_size": st.topo.node_size, "config": st.cfg.to_dict(),
        "optimizer_steps": st.optimizer_steps, "step": values.get("step"),
        "torch": torch.__version__, "flats": [flat_layout(f) for f in st.flats],
        "buffers": {n: list(b.shape) for n, b in buffers.items()},
        "optimizer": _optimizer_state(st, opt, tensors) if opt is not None else None,
        "extra": values, "extra_kinds": kinds, "hf": _hf_model(model),
    }
    return tensors, meta, manifest


def _optimizer_state(st: ShardState, opt: torch.optim.Optimizer, tensors: dict) -> dict:
    """The manifest's hyper-parameters and state kinds per flat; state tensors go in `tensors`."""
    names = {id(f.primary_shard): f.name for f in st.flats}
    params = [p for g in opt.param_groups for p in g["params"]]
    if foreign := sum(1 for p in params if id(p) not in names):
        raise CheckpointError(f"the optimizer holds {foreign} tensor(s) that are not this model's "
                              "master shards (built before zeropp.shard(), or for another model)")
    sd = opt.state_dict()
    groups = [{**jsonable({k: v for k, v in g.items() if k != "params"}, "optimizer group"),
               "params": [names[id(params[i])] for i in g["params"]]}
              for g in sd["param_groups"]]
    state = {}
    for i, s in sd["state"].items():
        p, name = params[i], names[id(params[i])]
        kinds = state[name] = {}
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optim/{name}/{k}"] = v.detach().cpu().contiguous()
                kinds[k] = "sharded" if v.shape == p.shape else "rank"
            else:
                kinds[k] = {"value": jsonable(v, f"optimizer state {k!r}")}
    return {"class": type(opt).__name__, "param_groups": groups, "state": state}


# ---- load ---------------------------------------------------------------------------
def load_checkpoint(path: os.PathLike, model: nn.Module,
                    optimizer: Optional[torch.optim.Optimizer] = None,
                    **restore: Any) -> dict[str, Any]:
    """Load a checkpoint saved by `save_checkpoint` into the sharded `model` (and `optimizer`)
    at this world size. Collective. Returns the extras: JSON values, this rank's tensors,
    Generators and state dicts; a Generator or stateful object passed by keyword in `restore`
    is restored in place. Any problem is a CheckpointError naming it, raised on every rank."""
    st = get_state(model)
    if st.gathered_depth:
        raise CheckpointError("load_checkpoint inside zeropp.gathered(): the resident weights "
                              "would not see the loaded ones; load after the context")
    err, plan, undo = None, None, []
    try:
        plan = _read(Path(path), st, model, optimizer, restore, undo)
    except Exception as e:  # noqa: BLE001 - every failure must reach every rank
        err = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    try:
        agree(err, CheckpointError, "checkpoint")
    except CheckpointError:
        for put_back in reversed(undo):
            put_back()
        raise
    return _apply(plan, st, model, optimizer)


def _read(path: Path, st: ShardState, model: nn.Module, opt: Optional[torch.optim.Optimizer],
          restore: dict, undo: list) -> dict:
    path = resolve(path)
    man = read_manifest(path)
    rd = Reader(path, man)
    _check_names(man, st, model, path)
    same_world = man["world_size"] == st.topo.world_size
    rank = st.topo.rank
    where = param_index(man)
    shards, engine = {}, {}
    # qWD copies and error-feedback residuals continue only at the same world, node size and
    # config; otherwise the next gather refreshes in full and residuals start from 0 (said).
    same_topology = same_world and man.get("node_size") == st.topo.node_size
    changes = config_changes(man.get("config"), st.cfg)
    lost = same_topology and changes and any(k.startswith("engine/") for k in rd.file(rank).keys())
    if lost and rank == 0:
        warnings.warn(f"zeropp: {path} was saved with another {', '.join(changes)}: its qWD "
                      "copies and error-feedback residuals are not restored", stacklevel=3)
    for f in st.flats:
        same_layout = flat_layout(f) in man["flats"]  # (a layout names its flat)
        if same_topology and not changes and same_layout:
            prefix = f"engine/{f.name}/"
            engine[f.name] = {k[len(prefix):]: rd.get(rank, k)
                              for k in rd.file(rank).keys() if k.startswith(prefix)}
        if same_world and same_layout:  # this rank's own bytes
            shards[f.name] = rd.get(rank, f"model/{f.name}")
            continue
        values = _assemble(f, rank, rd, where, lambda name: f"model/{name}")
        shards[f.name] = (quantize(values, f.weight_bits, f.block).to_bytes()
                          if f.int_storage else values)
    buffers = {n: rd.get(0, f"buffer/{n}") for n in man.get("buffers", {})}
    opt_sd = _read_optimizer(man, rd, st, opt, where, same_world) if opt is not None else None
    meta = read_json(rd.file(rank).metadata()["zeropp"]) if same_world else None
    rng = {k: rd.get(rank, f"rng/{k}") for k in ("torch", "cuda")  # (torch's is never optional)
           if same_world and (k == "torch" or f"rng/{k}" in rd.file(rank).keys())}
    # JSON and state-dict extras: this rank's own, or at another world size rank 0's (manifest)
    src = meta if meta is not None and "extra_kinds" in meta else man
    kinds = src.get("extra_kinds", {})
    if missing := sorted(set(restore) - set(kinds)):
        raise CheckpointError(f"{path}: nothing saved under {', '.join(map(repr, missing))} "
                              f"(saved extras: {', '.join(kinds) or 'none'})")
    extras: dict[str, Any] = dict(src.get("extra", {}))
    for k, kind in kinds.items():
        if kind == "tensor" or kind.startswith("generator"):
            if same_world:
                extras[k] = rd.get(rank, f"extra/{k}")
            elif k in restore:
                raise CheckpointError(f"extra {k!r} is per-rank state saved at world size "
                                      f"{man['world_size']}; it cannot be restored at "
                                      f"{st.topo.world_size}")
        if k in extras and (kind.startswith("generator") or kind == "stateful" and k in restore):
            obj = restore[k] if k in restore else torch.Generator(device=kind.split(":", 1)[1])
            try:  # now, before the model: the likeliest part to fail (`undo` puts it back)
                gen = isinstance(obj, torch.Generator)
                put = obj.set_state if gen else obj.load_state_dict
                undo.append(partial(put, obj.get_state() if gen else deepcopy(obj.state_dict())))
                put(extras[k])
            except Exception as e:  # noqa: BLE001 - a CheckpointError naming the extra
                raise CheckpointError(f"extra {k!r}: its saved state does not load into this "
                                      f"{type(obj).__name__} ({type(e).__name__}: {e})") from None
            extras[k] = obj
    return {"man": man, "shards": shards, "buffers": buffers, "opt": opt_sd, "meta": meta,
            "rng": rng, "extras": extras, "extra_kinds": kinds, "engine": engine}


def flat_layout(f: FlatParam) -> dict:
    """Where everything of a flat buffer sits, as a manifest records it (JSON types)."""
    return {"name": f.name, "trainable": f.trainable, "numel": f.numel,
            "shard_numel": f.shard_numel, "block": f.block,
            "storage": f"int{f.weight_bits}" if f.int_storage else "float32",
            "params": [{"names": list(i.fqns), "shape": list(i.shape), "offset": i.offset}
                       for i in f.infos]}


def gather_master(f: FlatParam, comm: Comm) -> torch.Tensor:
    """A flat buffer's full fp32 master weights (every rank's shard; int storage dequantized)."""
    shard = f.primary_shard.detach()
    full = torch.empty(f.padded_numel, dtype=torch.float32, device=shard.device)
    out = (torch.empty(f.world_size * shard.numel(), dtype=torch.uint8, device=shard.device)
           if f.int_storage else full)
    comm.all_gather(out, shard, op="all_gather/state_dict").wait()
    if f.int_storage:
        dequantize_pieces(out, full, pieces=f.world_size, bits=f.weight_bits, block=f.block)
    return full


def unflatten(f: FlatParam, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Original tensors (every name) from a full flat buffer."""
    return {fqn: flat[i.offset:i.offset + i.numel].view(i.shape) for i in f.infos
            for fqn in i.fqns}


def config_changes(saved: Optional[dict], cfg: Config) -> dict[str, tuple]:
    """{field: (saved, now)} where a checkpoint's config and `cfg` differ in the numbers (not
    SCHEDULE_ONLY); a field the checkpoint lacks postdates it: its run behaved as the default."""
    now, was = {**_RETIRED, **cfg.to_dict()}, {**Config().to_dict(), **_RETIRED, **(saved or {})}
    return {k: (was[k], v) for k, v in now.items() if k not in SCHEDULE_ONLY and was[k] != v}


# Fields zeropp no longer has, at the value it now always behaves as: a checkpoint
# saved with another value has engine state of another form (docs/notebook.md).
_RETIRED = {"gradient_rotation": False, "gradient_stochastic_rounding": False,
            "weight_delta_stochastic_rounding": False, "weight_delta_bits": 4,
            "weight_copy_bits": 8, "error_feedback_dtype": "float32",
            "weight_refresh_every": None}


def _check_names(man: dict, st: ShardState, model: nn.Module, path: Path) -> None:
    """The model must have exactly the checkpoint's parameters and buffers."""
    saved = {n: tuple(p["shape"]) for n, (_, p) in param_index(man).items()}
    saved.update({n: tuple(s) for n, s in man.get("buffers", {}).items()})
    mine = {n: tuple(i.shape) for f in st.flats for i in f.infos for n in i.fqns}
    mine.update({n: tuple(b.shape) for n, b in _buffers(model).items()})
    for n in [*mine, *saved]:
        if n not in saved:
            raise CheckpointError(f"{path}: the model's {n!r} {mine[n]} is not in the checkpoint")
        if n not in mine:
            raise CheckpointError(f"{path}: the checkpoint's {n!r} {saved[n]} is not in the model")
        if saved[n] != mine[n]:
            raise CheckpointError(f"{path}: {n!r} has shape {saved[n]} in the checkpoint and "
                                  f"{mine[n]} in the model")


def _assemble(f: Any, rank: int, rd: Reader, where: dict, key: Any) -> torch.Tensor:
    """This rank's shard of flat `f`, assembled parameter by parameter from the saved flats
    (`key(saved flat name)` names the tensor to read)."""
    lo, hi = rank * f.shard_numel, (rank + 1) * f.shard_numel
    out = None
    for info in f.infos:
        a, b = max(lo, info.offset), min(hi, info.offset + info.numel)
        if a >= b:
            continue
        sf, sp = where[info.fqns[0]]
        piece = rd.values(sf, key(sf["name"]), sp["offset"] + a - info.offset,
                          sp["offset"] + b - info.offset)
        if out is None:
            out = torch.zeros(f.shard_numel, dtype=piece.dtype)
        out[a - lo:b - lo] = piece
    return out if out is not None else torch.zeros(f.shard_numel)  # all padding


def _read_optimizer(man: dict, rd: Reader, st: ShardState, opt: torch.optim.Optimizer,
                    where: dict, same_world: bool) -> dict:
    """The optimizer's state dict for this rank, in torch's format."""
    if (saved := man.get("optimizer")) is None:
        raise CheckpointError(f"{rd.path}: saved without an optimizer; load it without one")
    if saved["class"] != type(opt).__name__:
        raise CheckpointError(f"{rd.path}: optimizer state is for {saved['class']}, this "
                              f"optimizer is {type(opt).__name__}")
    flats = {id(f.primary_shard): f for f in st.flats}
    group_of = {n: i for i, g in enumerate(saved["param_groups"]) for n in g["params"]}
    if len(saved["param_groups"]) != len(opt.param_groups):
        raise CheckpointError(f"{rd.path}: {len(saved['param_groups'])} optimizer param "
                              f"group(s) saved, this optimizer has {len(opt.param_groups)}")
    sd: dict[str, Any] = {"state": {}, "param_groups": []}
    idx = 0  # torch numbers the parameters across groups
    for gi, g in enumerate(opt.param_groups):
        for p in g["params"]:
            if (f := flats.get(id(p))) is None:
                raise CheckpointError("the optimizer holds tensors that are not this model's "
                                      "master shards (built before zeropp.shard()?)")
            srcs = {i.fqns[0]: where[i.fqns[0]][0]["name"] for i in f.infos}  # saved flats
            fresh = [n for n, s in srcs.items() if s not in saved["state"]]
            if fresh and len(fresh) < len(srcs):  # one step count per flat: no part is fresh
                raise CheckpointError(f"{rd.path}: optimizer state saved for part of {f.name}, none"
                                      f" for {', '.join(fresh[:3])}: load without the optimizer")
            src = srcs[f.infos[0].fqns[0]]
            if group_of.get(src) != gi:
                raise CheckpointError(f"{rd.path}: {f.name} is in optimizer group {gi} here "
                                      f"and in group {group_of.get(src)} in the checkpoint")
            for k, kind in saved["state"].get(src, {}).items():
                if kind == "sharded":
                    v = _assemble(f, st.topo.rank, rd, where, lambda name, k=k: f"optim/{name}/{k}")
                elif kind == "rank":  # e.g. a step count: the same on every rank
                    v = rd.get(st.topo.rank if same_world else 0, f"optim/{src}/{k}")
                else:
                    v = kind["value"]
                sd["state"].setdefault(idx, {})[k] = v
            idx += 1
        hp = {k: (tuple(v) if isinstance(g.get(k), tuple) else v)
              for k, v in saved["param_groups"][gi].items() if k != "params"}
        sd["param_groups"].append({**hp, "params": list(range(idx - len(g["params"]), idx))})
    return sd


def _apply(plan: dict, st: ShardState, model: nn.Module,
           opt: Optional[torch.optim.Optimizer]) -> dict[str, Any]:
    with torch.no_grad():
        for u in st.units:  # first: a gather in flight finishes on the old weights
            u.free()
            for f in u.flats:  # persistent: gathered again by the next forward (DeepSpeed's way)
                f.free(let_go=True, force=True)
        for f in st.flats:
            f.primary_shard.copy_(plan["shards"][f.name])  # bumps the version counter
            f.primary_shard.grad = None  # gradients of the replaced weights mean nothing
            f.buffer.load_state(plan["engine"].get(f.name, {}), f.primary_shard.device)
        bufs = _buffers(model)
        for n, t in plan["buffers"].items():
            bufs[n].copy_(t)
    if opt is not None:
        opt.load_state_dict(plan["opt"])
    man = plan["man"]
    st.optimizer_steps = man.get("optimizer_steps", 0)
    if plan["meta"] is not None:
        torch.set_rng_state(plan["rng"]["torch"])
        if "cuda" in plan["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(plan["rng"]["cuda"])
        py, n = plan["meta"]["python_rng"], plan["meta"]["numpy_rng"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))
    elif st.topo.rank == 0:
        warnings.warn(f"zeropp: checkpoint saved at world size {man['world_size']}, loaded at "
                      f"{st.topo.world_size}: weights and optimizer state resharded; per-rank "
                      "RNG states and per-rank tensors were not restored; JSON and "
                      "state-dict extras are rank 0's on every rank", stacklevel=3)
    return plan["extras"]
