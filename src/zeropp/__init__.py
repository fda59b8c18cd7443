"""zeropp: ZeRO-3 sharded data parallelism with the ZeRO++ communication
optimizations, in plain PyTorch on torch.distributed.

DeepSpeed scripts run on it with `import zeropp as deepspeed` (`initialize`,
`init_distributed`, `zero`, `comm`, `accelerator`; see zeropp/deepspeed/), and
Hugging Face's Trainer, accelerate and TRL after `zeropp.install_as_deepspeed()`."""

from .cli import quiet_start  # noqa: F401, I001 (first, before torch: a Ctrl-C as it loads)
import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

from . import config as _config
from .checkpoint import full_state_dict, load_checkpoint, save_checkpoint
from .checkpoint_files import CheckpointError
from .config import Config
from .deferred import deferred_init
from .gathered import gathered
from .memory import memory_stats
from .optim import clip_grad_norm_
from .shard import comm_stats, refresh, reset_comm_stats, shard
from .topology import Topology, get_topology

# The DeepSpeed front door (zeropp/deepspeed/) is imported on the first use of a name
# (None: the module of that name); `import zeropp` loads the engine only.
_FRONT_DOOR = {"initialize": "compat", "init_distributed": "compat", "zero": None,
               "add_config_arguments": "compat", "DeepSpeedEngine": "engine", "comm": None,
               "DeepSpeedConfigError": "config", "get_accelerator": "accelerator",
               "install_as_deepspeed": "alias", "accelerator": None, "lr_schedules": None}

__all__ = ["Config", "Topology", "get_topology", "shard", "clip_grad_norm_", "comm_stats",
           "reset_comm_stats", "refresh", "gathered", "full_state_dict", "save_checkpoint",
           "load_checkpoint", "CheckpointError", "initialize", "init_distributed",
           "add_config_arguments", "DeepSpeedEngine", "zero", "comm", "accelerator",
           "install_as_deepspeed", "get_accelerator", "memory_stats", "deferred_init",
           "DeepSpeedConfigError"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """The front door's names, imported on first use; `zeropp.fsdp2` (torch's FSDP2 is a
    slow import nothing else needs) and `zeropp.ft` (torchft's users') likewise."""
    if name in _FRONT_DOOR:
        where = _FRONT_DOOR[name]
        module = importlib.import_module(f"{__name__}.deepspeed.{where or name}")
        return module if where is None else getattr(module, name)
    if name in ("fsdp2", "ft"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Aliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import zeropp.zero` (each None of _FRONT_DOOR): the front door's module itself."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        parent, _, sub = fullname.rpartition(".")
        ours = parent == __name__ and sub in _FRONT_DOOR and _FRONT_DOOR[sub] is None
        return importlib.util.spec_from_loader(fullname, self) if ours else None

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module(f"{__name__}.deepspeed.{spec.name.rpartition('.')[2]}")

    def exec_module(self, module: Any) -> None:
        pass


if not any(isinstance(f, _Aliases) for f in sys.meta_path):
    sys.meta_path.append(_Aliases())

_config._DEEPSPEED[:] = _config._DEEPSPEED or [lambda *a, **k: importlib.import_module(
    f"{__name__}.deepspeed.zero_config").zero_config(*a, **k)]  # Config.from_deepspeed
