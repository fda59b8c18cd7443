"""DeepSpeed names that scripts and DeepSpeed's own tests import at module level
for features zeropp does not have: importable, refused (one line) when used.

A file that imports `PipelineModule` or `CPUAdamBuilder` at its top would
otherwise fail whole, the ZeRO-3 code in it included (DeepSpeed's `unit/
simple_model.py` imports `deepspeed.pipe` for its pipeline models, and most
ZeRO-3 tests import it). So, as DeepSpeed itself behaves when its compiled ops
are not built:
- op builders report themselves not compatible (`is_compatible()` False,
  `deepspeed.ops.__compatible_ops__` all False) and refuse to `load()`;
- pipeline classes and DeepSpeed's memory-efficient linear refuse to be used;
- DeepSpeed's own optimizer types and other internals exist for `isinstance`
  and nothing is an instance of them (zeropp's engine runs a torch optimizer
  over the shards); building or calling one says it is DeepSpeed-internal;
- plain constants and enums are what DeepSpeed's are (`OffloadDeviceEnum`:
  the offload a config names is then refused by `initialize`).
`git_version_info` reports this torch and no installed ops.
"""

from __future__ import annotations

import enum
import os
from typing import Any

import torch

from ..guards import one_line
from . import config

# DeepSpeed's op builders (deepspeed/ops/op_builder/all_ops.py), by builder class.
_BUILDERS = {"CPUAdamBuilder": "cpu_adam", "CPUAdagradBuilder": "cpu_adagrad",
             "CPULionBuilder": "cpu_lion", "FusedAdamBuilder": "fused_adam",
             "FusedLambBuilder": "fused_lamb", "FusedLionBuilder": "fused_lion",
             "AsyncIOBuilder": "async_io", "GDSBuilder": "gds",
             "QuantizerBuilder": "quantizer", "TransformerBuilder": "transformer",
             "StochasticTransformerBuilder": "stochastic_transformer",
             "SparseAttnBuilder": "sparse_attn", "InferenceBuilder": "transformer_inference",
             "RandomLTDBuilder": "random_ltd", "FPQuantizerBuilder": "fp_quantizer",
             "SpatialInferenceBuilder": "spatial_inference", "EvoformerAttnBuilder": "evoformer_attn"}


def refuse(what: str) -> NotImplementedError:
    return one_line(NotImplementedError(f"zeropp: {what} is not part of zeropp"))


def internal(name: str, what: str) -> NotImplementedError:
    """The refusal of a DeepSpeed implementation detail (not a feature zeropp lacks)."""
    return one_line(NotImplementedError(
        f"zeropp: {name} is DeepSpeed-internal ({what}); zeropp has no such object"))


def _builder(cls_name: str, op: str) -> type:
    def load(self: Any, verbose: bool = True) -> Any:
        raise refuse(f"DeepSpeed's compiled op {op!r} ({cls_name}; use torch.optim)")

    return type(cls_name, (), {"NAME": op, "__init__": lambda self, *a, **k: None,
                               "is_compatible": lambda self, verbose=False: False,
                               "load": load, "jit_load": load,
                               "__doc__": f"DeepSpeed's {op} op builder: never built here."})


def _refused_class(name: str, what: str) -> type:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        raise refuse(f"deepspeed {name} ({what})")

    return type(name, (), {"__init__": init, "__doc__": f"{what}: refused when built."})


def _absent_type(name: str, what: str = "a class of its ZeRO implementation") -> type:
    """A DeepSpeed class for isinstance checks: zeropp builds none."""
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        raise internal(name, what)

    return type(name, (), {"__init__": init,
                           "__doc__": f"DeepSpeed's {name}: nothing here is an instance."})


def _internal_function(name: str, what: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise internal(name, what)
    call.__name__ = call.__qualname__ = name.rsplit(".", 1)[-1]
    return call


def _refused_function(name: str, what: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise refuse(f"deepspeed {name} ({what})")
    call.__name__ = call.__qualname__ = name.rsplit(".", 1)[-1]
    return call


class ZeRORuntimeException(Exception):
    """DeepSpeed's error for a ZeRO setup it rejects at run time; zeropp's
    refusals of such setups are DeepSpeedConfigError (a config key) instead."""


class OffloadDeviceEnum(str, enum.Enum):
    """DeepSpeed's offload devices; a config naming cpu or nvme is refused."""
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    """DeepSpeed's offloadable state kinds (offload_states is not part of zeropp)."""
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


def required_torch_version(min_version: Any = None, max_version: Any = None) -> bool:
    """Whether this torch lies in [min_version, max_version] (either may be None)."""
    if not (min_version or max_version):
        raise ValueError("required_torch_version: give min_version or max_version")

    def parse(v: Any) -> tuple:
        return tuple(int("".join(c for c in x if c.isdigit()) or 0)
                     for x in str(v).split("+")[0].split(".")[:3])
    now = parse(torch.__version__)
    return not ((min_version and parse(min_version) > now)
                or (max_version and parse(max_version) < now))


def clone_tensors_for_torch_save(item: Any, device: Any = "cpu") -> Any:
    """`item` with every tensor in it (nested lists, tuples, dicts) cloned to `device`."""
    if isinstance(item, torch.Tensor):
        return item.detach().clone().to(torch.device(device))
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(x, device) for x in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """DeepSpeed's model-states file name (zeropp's checkpoints are another format)."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")


def git_version_info() -> dict[str, Any]:
    cuda = torch.version.cuda or "0.0"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "0.0"
    return {"version": None, "git_hash": "[zeropp]", "git_branch": "[zeropp]",
            "installed_ops": dict.fromkeys(_BUILDERS.values(), False),
            "compatible_ops": dict.fromkeys(_BUILDERS.values(), False),
            "accelerator_name": "cuda" if torch.cuda.is_available() else "cpu",
            "torch_info": {"version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
                           "bf16_support": True, "cuda_version": cuda,
                           "nccl_version": nccl, "hip_version": "0.0"}}


# deepspeed.runtime.torch_autocast: its per-parameter communication dtype is an
# attribute DeepSpeed's engine sets when the config's torch_autocast section is on;
# zeropp refuses that section (config.py), so no parameter has it and the readers
# answer the parameter's own dtype, as DeepSpeed's do for a parameter without it.
PARAM_COMM_DTYPE_ATTR_NAME = "comm_dtype"


def has_comm_dtype(param: torch.Tensor) -> bool:
    return hasattr(param, PARAM_COMM_DTYPE_ATTR_NAME)


def get_comm_dtype(param: torch.Tensor) -> torch.dtype:
    return getattr(param, PARAM_COMM_DTYPE_ATTR_NAME, param.dtype)


def get_allgather_dtype(param: torch.Tensor, param_ds_tensor: torch.Tensor) -> torch.dtype:
    """partition_parameters' gather dtype: the comm dtype, else the partition's."""
    return get_comm_dtype(param) if has_comm_dtype(param) else param_ds_tensor.dtype


def _torch_autocast() -> dict[str, Any]:
    return {"PARAM_COMM_DTYPE_ATTR_NAME": PARAM_COMM_DTYPE_ATTR_NAME,
            "has_comm_dtype": has_comm_dtype, "get_comm_dtype": get_comm_dtype,
            "get_all_comm_dtypes": lambda params: {get_comm_dtype(p) for p in params},
            "is_autocast_initialized": lambda: False, "get_autocast_dtype": lambda: None,
            "init_autocast_params": _refused_function(
                "init_autocast_params", "the torch_autocast config section")}


# DeepSpeed's memory-efficient linear (zero_optimization.memory_efficient_linear, on by
# default there): an F.linear that keeps no gathered weight for backward. zeropp keeps
# torch's F.linear; the key is accepted and changes nothing (config.py).
_LINEAR_WHAT = "DeepSpeed's memory-efficient linear; zeropp runs torch's F.linear"
LinearFunctionForZeroStage3 = _refused_class("LinearFunctionForZeroStage3", _LINEAR_WHAT)
LinearFunctionForZeroStage3.apply = staticmethod(
    _refused_function("LinearFunctionForZeroStage3.apply", _LINEAR_WHAT))
zero3_linear_wrap = _refused_function("zero3_linear_wrap", _LINEAR_WHAT)

# DeepSpeed-internal classes its ZeRO-3 tests import at module level (for isinstance
# checks, monkeypatching, direct construction): types of which nothing is an instance.
PARTITION_PARAMETERS_TYPES = ("MultipleAllGatherHandles", "InsertPostInitMethodToModuleSubClasses",
                              "CUDAQuantizer")


def absent_types(names: Any) -> dict[str, type]:
    return {n: _absent_type(n) for n in names}


def namespaces(package: Any, version: str) -> dict[str, Any]:
    """name -> module for the alias (alias.py); `package` builds a namespace module."""
    builders = {cls: _builder(cls, op) for cls, op in _BUILDERS.items()}
    info = {**git_version_info(), "version": version}
    offload_configs = {n: _refused_class(n, "ZeRO-Offload") for n in (
        "DeepSpeedZeroOffloadParamConfig", "DeepSpeedZeroOffloadOptimizerConfig")}
    # accelerate swaps a torch optimizer for one of these when the config offloads it, before
    # initialize could refuse the offload: the refusal names the key (it named deepspeed.ops).
    cpu_optimizers = {n: _refused_class(n, "ZeRO-Offload's CPU optimizer; set zero_optimization."
                                        "offload_optimizer.device to \"none\"")
                      for n in ("DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion")}
    pipe = {"PipelineModule": _refused_class("PipelineModule", "pipeline parallelism"),
            "LayerSpec": _refused_class("LayerSpec", "pipeline parallelism"),
            "TiedLayerSpec": _refused_class("TiedLayerSpec", "pipeline parallelism")}
    return {
        "deepspeed.git_version_info": package("deepspeed.git_version_info", **info),
        "deepspeed.ops": package("deepspeed.ops", __compatible_ops__=info["compatible_ops"]),
        "deepspeed.ops.op_builder": package("deepspeed.ops.op_builder", **builders),
        "deepspeed.ops.aio": package("deepspeed.ops.aio", AsyncIOBuilder=builders["AsyncIOBuilder"]),
        **{f"deepspeed.ops.{m}": package(f"deepspeed.ops.{m}", **{n: cpu_optimizers[n]})
           for m, n in (("adam", "DeepSpeedCPUAdam"), ("adagrad", "DeepSpeedCPUAdagrad"),
                        ("lion", "DeepSpeedCPULion"))},
        "deepspeed.pipe": package("deepspeed.pipe", **pipe),
        "deepspeed.runtime.pipe": package("deepspeed.runtime.pipe", **pipe),
        "deepspeed.runtime.pipe.module": package("deepspeed.runtime.pipe.module", **pipe),
        "deepspeed.runtime.zero.offload_config": package(
            "deepspeed.runtime.zero.offload_config", OffloadDeviceEnum=OffloadDeviceEnum,
            OffloadStateTypeEnum=OffloadStateTypeEnum, **offload_configs),
        "deepspeed.runtime.zero.config": package(
            "deepspeed.runtime.zero.config", **offload_configs,
            DeepSpeedZeroConfig=_absent_type(
                "DeepSpeedZeroConfig", "DeepSpeed's pydantic model of zero_optimization; zeropp "
                "reads the section in zeropp.deepspeed.config.parse")),
        "deepspeed.runtime.zero.leaf_module_config": package(
            "deepspeed.runtime.zero.leaf_module_config",
            DEFAULT_LEAF_MODULE_CLASSES=config.DEFAULT_LEAF_MODULE_CLASSES,
            DEFAULT_LEAF_MODULE_NAMES=config.DEFAULT_LEAF_MODULE_NAMES,
            DEFAULT_LEAF_MODULE_NAME_SUFFIXES=config.DEFAULT_LEAF_MODULE_NAME_SUFFIXES),
        "deepspeed.runtime.zero.parameter_offload": package(
            "deepspeed.runtime.zero.parameter_offload",
            ZeROOrderedDict=_absent_type("ZeROOrderedDict", "ZeRO-3's module parameter dict"),
            ensure_zero_ordered_dict=_internal_function(
                "ensure_zero_ordered_dict", "ZeRO-3's module parameter dict"),
            DeepSpeedZeRoOffload=_absent_type("DeepSpeedZeRoOffload")),
        "deepspeed.runtime.zero.linear": package(
            "deepspeed.runtime.zero.linear", zero3_linear_wrap=zero3_linear_wrap,
            LinearFunctionForZeroStage3=LinearFunctionForZeroStage3),
        "deepspeed.runtime.torch_autocast": package("deepspeed.runtime.torch_autocast",
                                                    **_torch_autocast()),
        "deepspeed.runtime.zero.utils": package("deepspeed.runtime.zero.utils",
                                                ZeRORuntimeException=ZeRORuntimeException),
        "deepspeed.runtime.swap_tensor": package("deepspeed.runtime.swap_tensor",
                                                 MIN_SWAPPABLE_BYTES=1024 ** 2),
        "deepspeed.runtime.zero.stage3": package(
            "deepspeed.runtime.zero.stage3",
            DeepSpeedZeroOptimizer_Stage3=_absent_type("DeepSpeedZeroOptimizer_Stage3")),
        "deepspeed.runtime.zero.stage_1_and_2": package(
            "deepspeed.runtime.zero.stage_1_and_2",
            DeepSpeedZeroOptimizer=_absent_type("DeepSpeedZeroOptimizer")),
        "deepspeed.runtime.bf16_optimizer": package(
            "deepspeed.runtime.bf16_optimizer", BF16_Optimizer=_absent_type("BF16_Optimizer")),
        "deepspeed.runtime.base_optimizer": package(
            "deepspeed.runtime.base_optimizer", ZeROOptimizer=_absent_type("ZeROOptimizer")),
        "deepspeed.runtime.fp16": package("deepspeed.runtime.fp16"),
        "deepspeed.runtime.fp16.fused_optimizer": package(
            "deepspeed.runtime.fp16.fused_optimizer", FP16_Optimizer=_absent_type("FP16_Optimizer")),
        "deepspeed.runtime.fp16.unfused_optimizer": package(
            "deepspeed.runtime.fp16.unfused_optimizer",
            FP16_UnfusedOptimizer=_absent_type("FP16_UnfusedOptimizer")),
        "deepspeed.utils.torch": package("deepspeed.utils.torch",
                                         required_torch_version=required_torch_version),
        "deepspeed.checkpoint": package("deepspeed.checkpoint"),
        "deepspeed.checkpoint.utils": package(
            "deepspeed.checkpoint.utils", clone_tensors_for_torch_save=clone_tensors_for_torch_save,
            get_model_ckpt_name_for_rank=get_model_ckpt_name_for_rank),
    }
