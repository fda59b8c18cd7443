"""CommStats: what this rank sent, per collective, split the way the paper splits it.

`collectives.py` records every collective zeropp issues with the bytes this rank puts on the
wire, split into payload and scales (qwZ's / qgZ's fp32 scales), and into the part that stays
inside the node and the part that crosses a node boundary. `inter_node_bytes` summed over a
node's ranks is what its network interface transmits: the figure ZeRO++ exists to cut, which the
emulated cluster's interface counters check.
"""

from __future__ import annotations

import threading
from collections import defaultdict


def ring_send(nbytes: float, group: int, passes: int = 1) -> float:
    """The byte model of a ring: what each of `group` ranks sends for a collective over an
    `nbytes` buffer (all-gather output, reduce-scatter input; an all-reduce is two passes).
    A node-major ring over the world crosses each node boundary once, so this is also what
    a node sends across it; collectives.py, `zeropp plan` and the ZeRO-3 line use it."""
    return passes * (group - 1) / group * nbytes


def _zero_op() -> dict:
    return {"group": "", "calls": 0, "payload_bytes": 0, "scale_bytes": 0,
            "inter_node_bytes": 0, "intra_node_bytes": 0}


class CommStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # the reduce pipeline records from its thread
        self.reset()

    def reset(self) -> None:
        self.by_op: dict[str, dict] = defaultdict(_zero_op)
        self.by_unit: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.steps = 0

    def record(self, op: str, *, group: str, sent: float, inter: float, scale: float = 0.0) -> None:
        """`group`: "world", "intra_node", "inter_node" or "hpz"; `sent`: all bytes this rank
        sends (payload + scales), of which `inter` leave the node and `scale` are scales."""
        with self._lock:
            rec = self.by_op[op]
            rec["group"] = group
            rec["calls"] += 1
            rec["payload_bytes"] += round(sent - scale)
            rec["scale_bytes"] += round(scale)
            rec["inter_node_bytes"] += round(inter)
            rec["intra_node_bytes"] += round(sent - inter)

    def count_unit(self, unit: str, event: str) -> None:
        """One unit-level event (a unit's gather may be several collectives)."""
        with self._lock:
            self.by_unit[unit][event] += 1

    def as_dict(self) -> dict:
        ops = {k: dict(v) for k, v in self.by_op.items()}
        totals = ("inter_node_bytes", "intra_node_bytes", "scale_bytes")
        return {**{k: sum(v[k] for v in ops.values()) for k in totals}, "by_op": ops,
                "by_unit": {u: dict(c) for u, c in self.by_unit.items()}, "steps": self.steps}
