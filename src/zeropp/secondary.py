"""hpZ: the secondary shard, this rank's 1/P slice of a unit's gathered weights.

After a world gather, rank i of an hpZ group of P ranks keeps slice i of what
arrived: the shards of world ranks [i*W/P, (i+1)*W/P), contiguous. Until the
master shard changes, a gather of the unit is an all-gather of these slices
inside the hpZ group (inside the node for P = D), which reassembles exactly
the buffer the world gather produced. With qwZ the slice is the INT8 payload
and scales as received (not dequantized weights): half the memory of
DeepSpeed's fp16 secondary, and backward dequantizes the very bytes forward
did, so both see bit-identical weights (DeepSpeed re-quantizes dequantized
weights, so its backward sees weights quantized twice).

A secondary is dropped after every optimizer step over its master shard (a
post-step hook: fused optimizers do not bump version counters) and is stale
once the shard's version counter moves or its storage is replaced
(`load_state_dict`, checkpoint loads), so no call is needed after a step or a
load; frozen parameters keep their slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SecondaryShard:
    data: torch.Tensor   # slice of the gathered buffer: compute dtype, or wire bytes (qwZ)
    version: tuple       # the master shard's (version counter, storage) when kept

    @classmethod
    def keep(cls, gathered: torch.Tensor, *, size: int, index: int,
             version: tuple) -> SecondaryShard:
        return cls(gathered.view(size, -1)[index].clone(), version)

    def valid_for(self, version: tuple) -> bool:
        return self.version == version
