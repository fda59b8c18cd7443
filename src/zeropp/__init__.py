"""zeropp: ZeRO-3 sharded data parallelism with the ZeRO++ communication
optimizations, in plain PyTorch on torch.distributed."""

from .checkpoint import full_state_dict, load_checkpoint, save_checkpoint
from .checkpoint_files import CheckpointError
from .config import Config
from .gathered import gathered
from .optim import clip_grad_norm_
from .shard import comm_stats, refresh, reset_comm_stats, shard
from .topology import Topology, get_topology

__all__ = ["Config", "Topology", "get_topology", "shard", "clip_grad_norm_",
           "comm_stats", "reset_comm_stats", "refresh", "gathered", "full_state_dict", "save_checkpoint",
           "load_checkpoint", "CheckpointError"]
__version__ = "0.1.0"
