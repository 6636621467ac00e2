"""Fixed-bucket latency histograms kept as plain counts, so that a stats snapshot (which may
cross a process boundary as plain data) carries a real distribution, not just an average.

``LatencyHistogram`` counts one observation per tier call (``TierStats.record_read`` /
``record_write``); ``snapshot()`` is ``{"bounds": [...], "counts": [...], "sum": s}`` with
``counts[i]`` the observations ``<= bounds[i]`` and above ``bounds[i-1]`` (not cumulative) and
one more count past the last bound. The engine's /metrics turns it into a Prometheus histogram
(``kvtier_kv_tier_read_seconds``). Not thread-safe: its owner holds a lock. Torch-free.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

# One batched tier call: ~10 us (a host-slab lookup) to seconds (S3 under load).
TIER_CALL_BUCKETS_S = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class LatencyHistogram:
    """Counts of observations per bucket and their sum. Not thread-safe."""

    __slots__ = ("bounds", "_counts", "_sum")

    def __init__(self, bounds: tuple[float, ...] = TIER_CALL_BUCKETS_S) -> None:
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError("histogram bounds must be strictly increasing and non-empty")
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        """Count one observation (a negative one, from a clock step, counts as 0)."""
        seconds = max(0.0, seconds)
        self._counts[bisect_left(self.bounds, seconds)] += 1
        self._sum += seconds

    @property
    def count(self) -> int:
        return sum(self._counts)

    def snapshot(self) -> dict[str, Any]:
        """A copy as plain data: bounds, per-bucket (non-cumulative) counts, sum."""
        return {"bounds": list(self.bounds), "counts": list(self._counts), "sum": self._sum}
