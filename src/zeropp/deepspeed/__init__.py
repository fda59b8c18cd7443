"""DeepSpeed's script surface on zeropp: `initialize`, its engine, the config,
the schedules and `deepspeed.zero` / `.comm` / `.accelerator`, so a DeepSpeed
script runs with `import zeropp as deepspeed`, and Hugging Face's Trainer,
accelerate and TRL after `zeropp.install_as_deepspeed()` (alias.py).

  compat.py        initialize, add_config_arguments
  engine.py        DeepSpeedEngine: backward / step / accumulation (checkpoints:
                   engine_checkpoints.py)
  config.py        a ds_config.json with DeepSpeed's semantics
  lr_schedules.py  WarmupLR, WarmupDecayLR, WarmupCosineLR
  zero.py          GatheredParameters, Init, ZeroParamStatus, unwrap_model_for_generation
  attributes.py    ds_status / ds_shape / ds_id / ds_persist on zeropp's tensors
  parameters.py    engine.module.named_parameters(): the model's own parameters
  utils.py         deepspeed.utils: logging, leaf-module flags, the tensor-fragment API
                   (tensor_fragment.py), zero_to_fp32 (zero_to_fp32.py)
  accelerator.py   get_accelerator(): CUDA or CPU
  comm.py          deepspeed.comm over torch.distributed, init_distributed
  alias.py         install_as_deepspeed(): `import deepspeed` answers with these
  grad_sync.py     engine.no_sync() / coalesce_grad_reduction() (coalesce.py: one
                   reduction per unit for several backwards)
"""

from . import accelerator, comm, lr_schedules, zero
from .accelerator import get_accelerator
from .compat import add_config_arguments, init_distributed, initialize
from .config import DeepSpeedConfigError
from .engine import DeepSpeedEngine

__all__ = ["initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine", "zero",
           "comm", "accelerator", "lr_schedules", "get_accelerator", "DeepSpeedConfigError"]
