"""zeropp: ZeRO-3 sharded data parallelism with the ZeRO++ communication
optimizations, in plain PyTorch on torch.distributed.

DeepSpeed scripts run on it with `import zeropp as deepspeed`: `initialize`,
`init_distributed`, `add_config_arguments` and `zero.GatheredParameters`."""

from . import zero
from .checkpoint import full_state_dict, load_checkpoint, save_checkpoint
from .checkpoint_files import CheckpointError
from .config import Config
from .deepspeed_compat import add_config_arguments, init_distributed, initialize
from .engine import DeepSpeedEngine
from .gathered import gathered
from .optim import clip_grad_norm_
from .shard import comm_stats, refresh, reset_comm_stats, shard
from .topology import Topology, get_topology

__all__ = ["Config", "Topology", "get_topology", "shard", "clip_grad_norm_", "comm_stats",
           "reset_comm_stats", "refresh", "gathered", "full_state_dict", "save_checkpoint",
           "load_checkpoint", "CheckpointError", "initialize", "init_distributed",
           "add_config_arguments", "DeepSpeedEngine", "zero"]
__version__ = "0.1.0"
