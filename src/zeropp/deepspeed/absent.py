"""DeepSpeed names that scripts and DeepSpeed's own tests import at module level
for features zeropp does not have: importable, refused (one line) when used.

A file that imports `PipelineModule` or `CPUAdamBuilder` at its top would
otherwise fail whole, the ZeRO-3 code in it included (DeepSpeed's `unit/
simple_model.py` imports `deepspeed.pipe` for its pipeline models, and most
ZeRO-3 tests import it). So, as DeepSpeed itself behaves when its compiled ops
are not built:
- op builders report themselves not compatible (`is_compatible()` False,
  `deepspeed.ops.__compatible_ops__` all False) and refuse to `load()`;
- pipeline classes refuse to be built;
- DeepSpeed's own optimizer types exist for `isinstance` and nothing is an
  instance of them (zeropp's engine runs a torch optimizer over the shards);
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


def _absent_type(name: str) -> type:
    """A DeepSpeed class for isinstance checks: zeropp builds none."""
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        raise refuse(f"DeepSpeed's {name}")

    return type(name, (), {"__init__": init,
                           "__doc__": f"DeepSpeed's {name}: nothing here is an instance."})


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
    pipe = {"PipelineModule": _refused_class("PipelineModule", "pipeline parallelism"),
            "LayerSpec": _refused_class("LayerSpec", "pipeline parallelism"),
            "TiedLayerSpec": _refused_class("TiedLayerSpec", "pipeline parallelism")}
    return {
        "deepspeed.git_version_info": package("deepspeed.git_version_info", **info),
        "deepspeed.ops": package("deepspeed.ops", __compatible_ops__=info["compatible_ops"]),
        "deepspeed.ops.op_builder": package("deepspeed.ops.op_builder", **builders),
        "deepspeed.ops.aio": package("deepspeed.ops.aio", AsyncIOBuilder=builders["AsyncIOBuilder"]),
        "deepspeed.pipe": package("deepspeed.pipe", **pipe),
        "deepspeed.runtime.pipe": package("deepspeed.runtime.pipe", **pipe),
        "deepspeed.runtime.pipe.module": package("deepspeed.runtime.pipe.module", **pipe),
        "deepspeed.runtime.zero.offload_config": package(
            "deepspeed.runtime.zero.offload_config", OffloadDeviceEnum=OffloadDeviceEnum,
            OffloadStateTypeEnum=OffloadStateTypeEnum),
        "deepspeed.runtime.zero.config": package(
            "deepspeed.runtime.zero.config", **absent_types(["DeepSpeedZeroConfig"])),
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
