"""zeropp: ZeRO-3 sharded data parallelism with the ZeRO++ communication
optimizations, in plain PyTorch on torch.distributed.

DeepSpeed scripts run on it with `import zeropp as deepspeed` (`initialize`,
`init_distributed`, `zero`, `comm`, `accelerator`; see zeropp/deepspeed/), and
Hugging Face's Trainer, accelerate and TRL after `zeropp.install_as_deepspeed()`."""

import importlib
import sys
from typing import Any

from .checkpoint import full_state_dict, load_checkpoint, save_checkpoint
from .checkpoint_files import CheckpointError
from .config import Config
from .deepspeed import (
    DeepSpeedConfigError,
    DeepSpeedEngine,
    accelerator,
    add_config_arguments,
    comm,
    get_accelerator,
    init_distributed,
    initialize,
    zero,
)
from .deepspeed.alias import install_as_deepspeed
from .deferred import deferred_init
from .gathered import gathered
from .memory import memory_stats
from .optim import clip_grad_norm_
from .shard import comm_stats, refresh, reset_comm_stats, shard
from .topology import Topology, get_topology

__all__ = ["Config", "Topology", "get_topology", "shard", "clip_grad_norm_", "comm_stats",
           "reset_comm_stats", "refresh", "gathered", "full_state_dict", "save_checkpoint",
           "load_checkpoint", "CheckpointError", "initialize", "init_distributed",
           "add_config_arguments", "DeepSpeedEngine", "zero", "comm", "accelerator",
           "install_as_deepspeed", "get_accelerator", "memory_stats", "deferred_init",
           "DeepSpeedConfigError"]
__version__ = "0.1.0"

# `from zeropp.accelerator import get_accelerator` (as scripts write it for deepspeed):
# the modules live in zeropp/deepspeed/, importable under these names too.
for _m in (zero, comm, accelerator):
    sys.modules.setdefault(f"{__name__}.{_m.__name__.rsplit('.', 1)[1]}", _m)


def __getattr__(name: str) -> Any:
    """`zeropp.fsdp2` and `zeropp.ft` after a plain `import zeropp`, imported on first
    use: fsdp2 imports torch.distributed.fsdp, a slow import that nothing else in zeropp
    needs; ft is for torchft's users."""
    if name in ("fsdp2", "ft"):  # ft: torchft's process groups, imported on use
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
