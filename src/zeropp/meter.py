"""GatherMeter: the full-weight buffers alive now and at peak (memory_stats reads it)."""

from __future__ import annotations

from typing import Any


class GatherMeter:
    """Full-weight buffers alive now and at peak; FlatParam reports each allocated and freed."""

    def __init__(self) -> None:
        self.alive: dict[int, tuple[Any, int]] = {}  # id(flat) -> (flat, bytes)
        self.peak_bytes = self.peak_units = 0

    def allocated(self, flat: Any, nbytes: int) -> None:
        self.alive[id(flat)] = (flat, nbytes)
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.peak_units = max(self.peak_units, self.units)

    def freed(self, flat: Any) -> None:
        self.alive.pop(id(flat), None)

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.alive.values())

    @property
    def units(self) -> int:
        return len({id(f.unit) for f, _ in self.alive.values()})

    def reset_peak(self) -> None:
        self.peak_bytes, self.peak_units = self.bytes, self.units
