"""A latency histogram kept as plain numbers, for metrics counted on the event loop.

Observing is a bisect and two additions; the event loop is the only writer, so no lock is
needed. prometheus-client's own Histogram takes a lock and builds label children on every
observation, which is too dear on the gateway's hot path. Both services turn these into
histogram families when scraped.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence


class Bounds:
    """The upper bounds of a histogram's buckets, with the names Prometheus gives them."""

    __slots__ = ("names", "values")

    def __init__(self, values: Sequence[float]) -> None:
        self.values = tuple(values)
        self.names = (*(repr(float(v)) for v in self.values), "+Inf")


class PlainHistogram:
    """Counts per bucket (the last one +Inf) and a sum."""

    __slots__ = ("_bounds", "_names", "counts", "sum")

    def __init__(self, bounds: Bounds) -> None:
        self._bounds = bounds.values
        self._names = bounds.names
        self.counts = [0] * len(bounds.names)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        """(bucket name, cumulative count) pairs, as a histogram family takes them."""
        cumulative = 0
        out: list[tuple[str, float]] = []
        for name, count in zip(self._names, self.counts, strict=True):
            cumulative += count
            out.append((name, cumulative))
        return out
