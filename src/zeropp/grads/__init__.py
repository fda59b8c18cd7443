"""The gradient path: a unit's full gradient becomes this rank's chunk of the world's mean.

  ring.py      ZeRO-3: one reduce-scatter over the world (RingReduce)
  qgz.py       qgZ: two quantized all-to-all hops, inside the node then across
               (QgzReduce), with the inter-node hop's codec (error feedback)
  pipeline.py  the reduce pipeline: the two stages of a route on two threads,
               off backward's critical path

A route's two stages, `first(comm, g)` and `second(comm, state)`, run on the pipeline's two threads
(so one unit's first stage overlaps the previous unit's second); `second` returns this rank's chunk
of the mean, fp32. `reduce(comm, g)` runs both. `route_for` picks each flat buffer's route, once.
"""

from __future__ import annotations

from typing import Union

from ..config import Config
from .qgz import QgzReduce
from .ring import RingReduce


def route_for(cfg: Config, *, block: int) -> Union[QgzReduce, RingReduce]:
    """The gradient route of a flat buffer (quantization blocks of `block`)."""
    return (QgzReduce.from_config(cfg, block=block) if cfg.quantized_gradients
            else RingReduce(cfg.reduce_dtype))
