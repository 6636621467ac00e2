"""LatencyHistogram: 'le' buckets (a value on a bound counts in that bound's bucket), one
bucket past the last bound, the sum, and bad bounds refused."""

from __future__ import annotations

import pytest

from cachestore.store.histogram import LatencyHistogram


def test_buckets_are_le_with_an_overflow_bucket_and_a_sum() -> None:
    h = LatencyHistogram((0.001, 0.01))
    for seconds in (0.0005, 0.001, 0.002, 0.01, 5.0, -1.0):
        h.observe(seconds)
    assert h.snapshot() == {
        "bounds": [0.001, 0.01],
        "counts": [3, 2, 1],
        "sum": pytest.approx(0.0005 + 0.001 + 0.002 + 0.01 + 5.0),
    }
    assert h.count == 6


@pytest.mark.parametrize("bounds", [(), (0.1, 0.1), (0.2, 0.1)])
def test_bounds_must_increase(bounds: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        LatencyHistogram(bounds)
