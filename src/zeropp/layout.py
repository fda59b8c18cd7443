"""How a flat buffer is cut into W shards of whole quantization blocks.

Quantized shards hold whole blocks, so a block never straddles two ranks: any size, any W.
Each shard is cut into as few blocks of at most `block_size` as it needs, of equal size rounded
up to a multiple of 8 (keeps wire pieces 4-byte aligned): padding stays under 8 per block.
Unquantized, a block is one element: a shard is ceil(numel / W) elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import Config


@dataclass(frozen=True)
class ShardLayout:
    numel: int        # elements that hold values
    world_size: int
    block: int        # quantization block (1: unquantized)
    shard_numel: int  # elements per rank, whole blocks

    @classmethod
    def of(cls, numel: int, world_size: int, cfg: Config) -> ShardLayout:
        per_rank = max(1, math.ceil(numel / world_size))
        nblocks = -(-per_rank // cfg.block_size)
        block = -(-per_rank // nblocks // 8) * 8 if cfg.quantized else 1
        return cls(numel, world_size, block, -(-per_rank // block) * block)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def valid(self, rank: int) -> int:
        """Elements of `rank`'s shard that hold values (the rest is padding)."""
        return min(self.shard_numel, max(0, self.numel - rank * self.shard_numel))
