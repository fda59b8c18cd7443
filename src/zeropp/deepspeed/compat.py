"""DeepSpeed's front door on zeropp: `initialize`, `init_distributed`,
`add_config_arguments`, so that `import zeropp as deepspeed` runs a DeepSpeed
training script (docs/deepspeed.md).

`initialize` builds, in DeepSpeed's order: the process group (from torchrun's
or the deepspeed launcher's environment, or one process), the config
(config.py), the sharded model (zeropp.shard with the config's ZeRO++
keys), the optimizer over the master shards, the LR schedule, the data loader
and the engine (engine.py).

[Note: optimizers over shards]
An optimizer built before `initialize` holds the model's original parameters,
which sharding replaces. It is rebuilt over the shards, in place: same class,
same hyper-parameters per param group. A unit's parameters of different param
groups (say, no weight decay for biases) go to different flat shards
(`shard(param_groups=...)`), so per-group settings hold exactly. A schedule
built on the client optimizer is re-pointed at the rebuilt one. A callable
`optimizer(params)` or `lr_scheduler(optimizer)` is called with the shards'
groups / the optimizer, as in DeepSpeed.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import warnings
import weakref
from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..deferred import is_deferred, show_module
from ..guards import one_line
from ..shard import get_state, shard
from . import config as ds_config
from . import lr_schedules, utils
from .alias import installed
from .attributes import ZeroParamStatus, attach, owner_of
from .comm import init_distributed
from .engine import DeepSpeedEngine
from .parameters import expose_original_parameters, master_shards
from .zero import add_gather_methods

_DS_OPTIMIZERS_NOT_HERE = {"lamb", "lion", "onebitadam", "zerooneadam", "onebitlamb", "muadam",
                           "muadamw", "musgd", "muon"}


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line flags: --deepspeed, --deepspeed_config (and the
    deprecated --deepscale, --deepscale_config)."""
    g = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (run by zeropp)")
    g.add_argument("--deepspeed", default=False, action="store_true",
                   help="enable DeepSpeed (always on under zeropp)")
    g.add_argument("--deepspeed_config", default=None, type=str,
                   help="DeepSpeed json configuration file")
    g.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def initialize(args: Any = None, model: Optional[nn.Module] = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None,
               dist_init_required: Optional[bool] = None, collate_fn: Any = None,
               config: Any = None, mesh_param: Any = None, config_params: Any = None
               ) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """DeepSpeed's `initialize` on zeropp: returns (engine, optimizer,
    training_dataloader, lr_scheduler). `config`: a dict or a JSON path
    (`config_params` is its old name; `args.deepspeed_config` works too)."""
    if model is None:
        raise ValueError("zeropp.initialize: a model is required")
    if mpu is not None or mesh_param is not None:
        raise ValueError("zeropp.initialize: model parallelism (mpu, mesh_param) is not "
                         "supported; zeropp is data-parallel ZeRO-3")
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    config = _config_source(args, config, config_params)
    try:
        ds = ds_config.parse(config, dist.get_world_size(), alias_installed=installed())
    except ValueError as e:  # a key to fix in the config: one line, not a traceback per rank
        raise one_line(ds_config.DeepSpeedConfigError(str(e))) from None
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    if hasattr(model, "_zeropp_state"):
        return _initialize_again(model, ds, optimizer, model_parameters, lr_scheduler,
                                 training_data, collate_fn, device)
    if any(hasattr(m, "_zeropp_unit") for m in model.modules()):
        raise ValueError("zeropp.initialize: a submodule of this model is already sharded; "
                         "pass the whole model")
    show_module(model)  # zero.Init's 0-element parameters: their tensors, to shard
    groups = _param_groups(model, model_parameters, optimizer)
    if device.type != "cpu" and any(map(is_deferred, model.parameters())):
        raise one_line(ValueError(
            "zeropp.initialize: a model built under zero.Init / zeropp.deferred_init is "
            "materialized on the CPU; on CUDA, build it whole (or shard it on the CPU)"))
    model.to(device)
    _mark_leaf_modules(model, ds.leaf_module)
    # As DeepSpeed: every rank starts from rank 0's weights (one unit at a time).
    module = shard(model, ds.zero, param_groups=[g["params"] for g in groups],
                   sync_module_states=True)
    opt = _optimizer(module, groups, optimizer, ds)
    sched = _scheduler(opt, optimizer, lr_scheduler, ds)
    loader = _dataloader(training_data, ds, collate_fn)
    engine = DeepSpeedEngine(module, ds, opt, sched, loader, device)
    _zero3_attributes(module, opt)
    expose_original_parameters(module, engine)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _mark_leaf_modules(model: nn.Module, leaf: dict) -> None:
    """The config's zero_optimization.leaf_module, as set_z3_leaf_modules would."""
    if leaf.get("classes"):
        utils.set_z3_leaf_modules(model, leaf["classes"], raise_if_not_found=False)
    if leaf.get("names"):
        utils.set_z3_leaf_modules_by_name(model, leaf["names"], raise_if_not_found=False)
    if leaf.get("name_suffixes"):
        utils.set_z3_leaf_modules_by_suffix(model, leaf["name_suffixes"],
                                            raise_if_not_found=False)


def _initialize_again(module: nn.Module, ds: ds_config.DSConfig, optimizer: Any,
                      model_parameters: Any, lr_scheduler: Any, training_data: Any,
                      collate_fn: Any, device: torch.device) -> tuple:
    """`initialize` of a model sharded before (by an earlier `initialize`, as DeepSpeed
    allows, or by zeropp.shard): a new engine, optimizer and schedule over the same
    shards, which keep their values. The ZeRO settings must be the ones it has."""
    st = get_state(module)
    if st.cfg != ds.zero:
        diff = [f"{k.name}: {getattr(st.cfg, k.name)!r} -> {getattr(ds.zero, k.name)!r}"
                for k in dataclasses.fields(st.cfg)
                if getattr(st.cfg, k.name) != getattr(ds.zero, k.name)]
        raise one_line(ds_config.DeepSpeedConfigError(
            "zeropp.initialize: this model is already sharded with other ZeRO settings ("
            + "; ".join(diff) + "); initialize an unsharded model to change them"))
    # Param groups over the shards: the parameters given (the module attributes an
    # engine's module yields, or the shards zeropp.shard's does) stand for their shards.
    groups = _param_groups(module, model_parameters, optimizer)
    groups = [{**g, "params": _shards_of(g["params"])} for g in groups]
    opt = _optimizer_over(groups, optimizer, ds)
    sched = _scheduler(opt, optimizer, lr_scheduler, ds)
    loader = _dataloader(training_data, ds, collate_fn)
    engine = DeepSpeedEngine(module, ds, opt, sched, loader, device)
    _zero3_attributes(module, opt)
    expose_original_parameters(module, engine)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


class _ParameterOffload:
    """What DeepSpeed ZeRO-3's optimizer exposes as `parameter_offload`: the module
    and its hook lists. TRL removes and re-adds those hooks around generation
    (`unwrap_model_for_generation`, inside GatheredParameters); zeropp's hooks do no
    collective while a unit is gathered, so they stay, and these lists are empty."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.forward_hooks: list = []
        self.backward_hooks: list = []

    def _register_deepspeed_module(self, module: nn.Module) -> None:
        pass


def _zero3_attributes(module: nn.Module, opt: Any) -> None:
    """The ZeRO-3 attributes libraries touch on the optimizer, the master shards
    and the root module (see _ParameterOffload), and the model's own parameters'
    `ds_*` (attributes.py)."""
    attach(module)
    if opt is not None:
        opt.parameter_offload = _ParameterOffload(module)
    for f in get_state(module).flats:  # the master shards: partitioned, always
        p = f.primary_shard
        p.ds_active_sub_modules = set()
        p.ds_status, p.ds_id = ZeroParamStatus.NOT_AVAILABLE, f.name
        # What DeepSpeed's parameters say of themselves: the full (flat) shape, and
        # this rank's partition (the tensor-fragment API's local piece).
        p.ds_shape, p.ds_numel, p.ds_tensor = torch.Size([f.numel]), f.numel, p
        p._zeropp_optimizer = weakref.ref(opt) if opt is not None else None
        for t in f.params:  # the model's own parameters (engine.module.named_parameters())
            t.ds_active_sub_modules = set()
            add_gather_methods(t)
    module.ds_external_parameters = lambda: []


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None and config is not None:
        raise ValueError("zeropp.initialize: a config was given both as --deepspeed_config and "
                         "as initialize(config=...); pass one")
    config = config if config is not None else from_args
    if config is None:
        raise ValueError("zeropp.initialize: no config; pass config=... (a dict or a JSON "
                         "path) or --deepspeed_config")
    return config


def _param_groups(model: nn.Module, model_parameters: Any, optimizer: Any) -> list[dict]:
    """The param groups (original parameters + their own hyper-parameters)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = [dict(g) for g in optimizer.param_groups]
    elif model_parameters is None:
        groups = [{"params": list(model.parameters())}]
    else:
        items = list(model_parameters) if isinstance(model_parameters, Iterable) \
            else [model_parameters]
        if items and all(isinstance(x, dict) for x in items):
            groups = [dict(x) for x in items]
            for g in groups:
                g["params"] = list(g["params"])
        else:
            groups = [{"params": items}]
    ours = {id(p) for p in model.parameters()}
    if hasattr(model, "_zeropp_state"):  # sharded: its shards stand for themselves too
        ours |= {id(p) for p in master_shards(model)}
    seen: set[int] = set()
    for g in groups:
        for p in g["params"]:
            if id(p) not in ours:
                raise ValueError("zeropp.initialize: the optimizer / model_parameters hold a "
                                 "tensor that is not a parameter of the model")
            if id(p) in seen:
                raise ValueError("zeropp.initialize: a parameter appears in two param groups")
            seen.add(id(p))
    # Trainable parameters in no group are accepted, as DeepSpeed accepts them: their
    # gradients are reduced, and no optimizer steps them.
    return groups


def _shards_of(params: list) -> list:
    """The trainable master shards holding `params` (shards or module attributes),
    each once, in order."""
    out: dict[int, torch.Tensor] = {}
    for p in params:
        f = owner_of(p)
        if f is not None and f.trainable:
            out.setdefault(id(f.primary_shard), f.primary_shard)
    return list(out.values())


def _shard_groups(module: nn.Module, groups: list[dict]) -> list[dict]:
    flats = get_state(module).flats
    out = []
    for k, g in enumerate(groups):
        params = [f.primary_shard for f in flats if f.trainable and f.param_group == k]
        # Kept even when empty (a group of frozen parameters): a client schedule's
        # per-group values must line up with the groups.
        out.append({**{key: v for key, v in g.items() if key != "params"}, "params": params})
    return out


def _optimizer(module: nn.Module, groups: list[dict], client: Any,
               ds: ds_config.DSConfig) -> Optional[torch.optim.Optimizer]:
    return _optimizer_over(_shard_groups(module, groups), client, ds)


def _optimizer_over(sgroups: list[dict], client: Any,
                    ds: ds_config.DSConfig) -> Optional[torch.optim.Optimizer]:
    """The optimizer over these groups of master shards: the client's, rebuilt, or
    the config's."""
    if client is not None:
        if ds.optimizer is not None:
            warnings.warn("zeropp.initialize: the config's optimizer section is ignored: a "
                          "client optimizer was passed (as DeepSpeed does)", stacklevel=3)
        if isinstance(client, torch.optim.Optimizer):
            # Every group carries its settings; pass only the defaults the class
            # takes (AdamW's defaults hold a key its constructor refuses).
            takes = inspect.signature(type(client).__init__).parameters
            defaults = {k: v for k, v in client.defaults.items() if k in takes}
            # Rebuilt in place (unless an engine already steps it): what holds the client
            # (a schedule initialize never sees, as accelerate keeps a LambdaLR, or
            # `opt.param_groups[0]["lr"] = ...`) then drives the steps, as under
            # DeepSpeed, whose ZeRO-3 steps the client's own param groups.
            opt = client if not hasattr(client, "parameter_offload") else \
                type(client).__new__(type(client))
            try:
                type(client).__init__(opt, sgroups, **defaults)
                return opt
            except TypeError as e:
                raise ValueError(f"zeropp.initialize: cannot rebuild {type(client).__name__} "
                                 f"over the shards ({e}); pass a callable `lambda params: "
                                 f"{type(client).__name__}(params, ...)` instead") from None
        if callable(client):
            return client(sgroups)
        raise ValueError(f"zeropp.initialize: optimizer={client!r} is neither an optimizer nor "
                         "a callable")
    if ds.optimizer is None:
        return None
    return _config_optimizer(ds.optimizer, sgroups)


def _config_optimizer(spec: dict, sgroups: list[dict]) -> torch.optim.Optimizer:
    name, params = spec["type"], dict(spec["params"])
    if "max_grad_norm" in params:
        raise ValueError("DeepSpeed config: optimizer.params.max_grad_norm is not supported; "
                         "use the top-level gradient_clipping")
    adam_w_mode = params.pop("adam_w_mode", True)
    torch_adam = params.pop("torch_adam", False)
    params.pop("fp32_optimizer_states", None)
    low = name.lower()
    if low in ("adam", "adamw"):
        cls = torch.optim.AdamW if low == "adamw" or adam_w_mode else torch.optim.Adam
        if params.pop("bias_correction", True) is not True:
            raise ValueError("DeepSpeed config: optimizer.params.bias_correction=false is not "
                             "supported")
        if not torch_adam:  # DeepSpeed's FusedAdam, which it uses then, defaults to no decay
            params.setdefault("weight_decay", 0.0)
    elif low == "sgd":
        cls = torch.optim.SGD
    elif low == "adagrad":
        cls = torch.optim.Adagrad
    elif low not in _DS_OPTIMIZERS_NOT_HERE and isinstance(getattr(torch.optim, name, None), type) \
            and issubclass(getattr(torch.optim, name), torch.optim.Optimizer):
        cls = getattr(torch.optim, name)
    else:
        raise ValueError(f"DeepSpeed config: optimizer.type={name!r} is not supported; allowed: "
                         "Adam, AdamW, SGD, Adagrad, or a torch.optim class name (e.g. RMSprop)")
    try:
        return cls(sgroups, **params)
    except (TypeError, ValueError) as e:
        raise ValueError(f"DeepSpeed config: optimizer.params for {name}: {e}") from None


def _scheduler(opt: Optional[torch.optim.Optimizer], client_opt: Any, client: Any,
               ds: ds_config.DSConfig) -> Any:
    if client is not None:  # DeepSpeed 0.19: a client schedule wins over the config's
        if ds.scheduler is not None:
            warnings.warn("zeropp.initialize: the config's scheduler section is ignored: a "
                          "client lr_scheduler was passed (as DeepSpeed does)", stacklevel=3)
        return _client_scheduler(opt, client_opt, client)
    if ds.scheduler is not None:
        if opt is None:
            raise ValueError("DeepSpeed config: a scheduler needs an optimizer")
        name, params = ds.scheduler["type"], ds.scheduler["params"]
        if name in lr_schedules.UNSUPPORTED:
            raise ValueError(f"DeepSpeed config: scheduler.type={name!r} is not supported by "
                             f"zeropp; allowed: {', '.join(lr_schedules.SCHEDULES)} or a "
                             "torch.optim.lr_scheduler class name")
        cls = lr_schedules.SCHEDULES.get(name) or getattr(torch.optim.lr_scheduler, name, None)
        if not isinstance(cls, type):
            raise ValueError(f"DeepSpeed config: scheduler.type={name!r} is unknown; allowed: "
                             f"{', '.join(lr_schedules.SCHEDULES)} or a "
                             "torch.optim.lr_scheduler class name")
        try:
            return cls(opt, **params)
        except TypeError as e:
            raise ValueError(f"DeepSpeed config: scheduler.params for {name}: {e}") from None
    return None


def _client_scheduler(opt: Any, client_opt: Any, client: Any) -> Any:
    if isinstance(client, type) or (callable(client) and not hasattr(client, "step")):
        return client(opt)  # a factory: DeepSpeed calls it with the optimizer
    if not (hasattr(client, "step") and hasattr(client, "state_dict")):
        raise ValueError(f"zeropp.initialize: lr_scheduler={client!r} is neither a scheduler "
                         "nor a callable")
    # A schedule built on the client optimizer, which was rebuilt over the shards:
    # point it (and the schedules inside a SequentialLR / ChainedScheduler) at the new one.
    pending, seen = [client], set()
    while pending:
        s = pending.pop()
        if id(s) in seen:
            continue
        seen.add(id(s))
        if getattr(s, "optimizer", None) is not None:
            if client_opt is None or s.optimizer is not client_opt:
                raise ValueError("zeropp.initialize: lr_scheduler is not built on the optimizer "
                                 "passed to initialize; pass that optimizer too, or a callable "
                                 "`lambda opt: Schedule(opt, ...)`")
            s.optimizer = opt
        pending += list(getattr(s, "_schedulers", []))
    return client


def _dataloader(data: Any, ds: ds_config.DSConfig, collate_fn: Any) -> Any:
    """DeepSpeed's loader: micro-batches, a DistributedSampler (shuffled with
    seed 0; like DeepSpeed it never calls set_epoch, so every pass has the same
    order), in-process loading."""
    if data is None:
        return None
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset
    if isinstance(data, IterableDataset):
        return DataLoader(data, batch_size=ds.micro_batch, collate_fn=collate_fn,
                          drop_last=ds.drop_last)
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise ValueError("zeropp.initialize: training_data must be a torch Dataset")
    sampler = DistributedSampler(data, num_replicas=dist.get_world_size(), rank=dist.get_rank())
    return DataLoader(data, batch_size=ds.micro_batch, sampler=sampler, collate_fn=collate_fn,
                      drop_last=ds.drop_last)
