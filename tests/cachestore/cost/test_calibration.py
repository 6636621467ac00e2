"""Calibration: exact fits of synthetic timings, and real measurements through LMDB / host."""

from __future__ import annotations

import pytest

from cachestore.cost.calibration import (
    calibrate,
    calibrate_copy,
    calibrate_prefill,
    calibrate_tier,
    fit_prefill_nonnegative,
)
from cachestore.cost.model import PrefillCost, PrefillSample, TierCost
from cachestore.cost.online import CostPriors
from tests.cachestore.store_helpers import DownTier
from tiers.host import HostTier
from tiers.lmdb import LmdbTier

TRUTH = PrefillCost(fixed_s=0.002, per_token_s=1e-5, attention_s=3e-9)


def test_calibrate_prefill_recovers_coefficients_and_counts_calls() -> None:
    calls: list[tuple[int, int]] = []

    def run(n: int, c: int) -> float:
        calls.append((n, c))
        return TRUTH.time(n, c)

    sizes = [(16, 0), (512, 0), (512, 4096), (2048, 1024)]
    fitted = calibrate_prefill(run, sizes, repeats=2, progress=False)
    assert fitted.fixed_s == pytest.approx(0.002, rel=1e-9)
    assert fitted.per_token_s == pytest.approx(1e-5, rel=1e-9)
    assert fitted.attention_s == pytest.approx(3e-9, rel=1e-9)
    assert calls == [(16, 0)] + [s for s in sizes for _ in range(2)]  # warm-up, then repeats


def test_calibrate_prefill_keeps_the_fastest_run() -> None:
    slow = iter([9.0] * 100)

    def run(n: int, c: int) -> float:  # first call of each size is a 9 s outlier
        run.count += 1  # type: ignore[attr-defined]
        return next(slow) if run.count % 2 == 0 else TRUTH.time(n, c)  # type: ignore[attr-defined]

    run.count = 0  # type: ignore[attr-defined]
    fitted = calibrate_prefill(run, [(16, 0), (512, 0), (2048, 1024)], progress=False)
    assert fitted.per_token_s == pytest.approx(1e-5, rel=1e-9)


def test_calibrate_prefill_rejects_too_few_sizes() -> None:
    with pytest.raises(ValueError, match="distinct"):
        calibrate_prefill(lambda n, c: 1.0, [(16, 0), (16, 0), (32, 0)], progress=False)


def test_nonnegative_fit_where_plain_least_squares_goes_negative() -> None:
    # Superlinear-looking noise: the unconstrained fit wants a negative fixed cost.
    samples = [
        PrefillSample(100, 0, 0.009),
        PrefillSample(200, 0, 0.020),
        PrefillSample(400, 0, 0.042),
        PrefillSample(800, 0, 0.085),
    ]
    plain = PrefillCost.fit(samples)
    assert plain.fixed_s < 0 or plain.attention_s < 0  # the case this guards against
    fitted = fit_prefill_nonnegative(samples)
    assert min(fitted.fixed_s, fitted.per_token_s, fitted.attention_s) >= 0
    assert all(fitted.time(s.num_tokens) == pytest.approx(s.seconds, rel=0.15) for s in samples)

    def sse(p: PrefillCost) -> float:
        return sum((p.time(s.num_tokens) - s.seconds) ** 2 for s in samples)

    # No worse than the best fit of the per-token term alone (one of the subsets it tries).
    b = sum(s.num_tokens * s.seconds for s in samples) / sum(s.num_tokens**2 for s in samples)
    assert sse(fitted) <= sse(PrefillCost(0.0, b, 0.0))


def test_calibrate_copy_separates_latency_and_bandwidth() -> None:
    cost = calibrate_copy(lambda n: 1e-3 + n * 1e-4, 1000, "x", num_blocks=16)
    assert cost.name == "x"
    assert cost.bandwidth_bytes_per_s == pytest.approx(1e7, rel=1e-9)
    assert cost.latency_s == pytest.approx(1e-3, rel=1e-9)
    # Noise made the large copy no slower than one block: all of it counts as bandwidth.
    flat = calibrate_copy(lambda n: 2e-3, 1000, "y", num_blocks=4)
    assert flat.bandwidth_bytes_per_s == pytest.approx(2e6, rel=1e-12)
    assert flat.latency_s == pytest.approx(2e-3 - 1000 / 2e6, rel=1e-12)


def test_calibrate_tier_on_real_lmdb_cleans_up(tmp_path) -> None:
    with LmdbTier(tmp_path / "lmdb", 64 << 20) as tier:
        tier.put_many([("ns/keep", b"x" * 100)])
        cost = calibrate_tier(tier, 64 << 10, num_blocks=16)
        assert cost.name == "lmdb"
        assert cost.bandwidth_bytes_per_s > 0 and cost.latency_s >= 0
        assert tier.usage().num_entries == 1 and tier.contains("ns/keep")


def test_calibrate_tier_refuses_a_tier_too_small() -> None:
    with HostTier(4 * 4096, 4096, pin_memory=False) as tier:
        with pytest.raises(ValueError, match="kept fewer"):
            calibrate_tier(tier, 4096, num_blocks=8)
        assert tier.usage().num_entries == 0


def test_calibrate_combines_measurements_and_priors(tmp_path) -> None:
    redis_prior = TierCost("redis", 5e-4, 2.5e9)
    priors = CostPriors("t", {"redis": redis_prior}, TRUTH, block_bytes=4096)
    host = HostTier(64 * 4096, 4096, pin_memory=False)
    lmdb = LmdbTier(tmp_path / "lmdb", 16 << 20)
    try:
        model = calibrate(
            [host, lmdb, DownTier(name="redis")],
            4096,
            16,
            lambda n, c: 2 * TRUTH.time(n, c),
            host_to_gpu=lambda n: 1e-5 + n * 4096 / 1e10,
            priors=priors,
            prefill_sizes=[(16, 0), (512, 0), (2048, 1024)],
            num_blocks=8,
            progress=False,
        )
    finally:
        host.close()
        lmdb.close()
    costs = model.tier_costs()
    assert set(costs) == {"host", "lmdb", "redis"}
    assert costs["host"].bandwidth_bytes_per_s == pytest.approx(1e10, rel=1e-9)
    assert costs["host"].latency_s == pytest.approx(1e-5, rel=1e-9)
    assert costs["lmdb"].bandwidth_bytes_per_s > 0
    assert costs["redis"] == redis_prior  # the broken tier keeps its prior
    assert model.prefill_cost().per_token_s == pytest.approx(2e-5, rel=1e-9)
    assert model.block_bytes == 4096 and model.block_tokens == 16
    with pytest.raises(ValueError, match="no prior"):
        calibrate([DownTier(name="redis")], 4096, 16, progress=False)


def test_calibrate_measures_the_host_hop_without_a_host_tier(tmp_path) -> None:
    with LmdbTier(tmp_path / "lmdb", 16 << 20) as lmdb:
        model = calibrate(
            [lmdb],
            4096,
            16,
            host_to_gpu=lambda n: 2e-5 + n * 4096 / 2e10,
            priors=CostPriors("t", {}, TRUTH, 4096),
            num_blocks=8,
            progress=False,
        )
    costs = model.tier_costs()
    assert costs["host"].bandwidth_bytes_per_s == pytest.approx(2e10, rel=1e-9)
    assert costs["host"].latency_s == pytest.approx(2e-5, rel=1e-9)
    assert model.prefill_cost() == TRUTH
    # An lmdb block now pays both hops in decide(), pipelined.
    d = model.decide(0, ["lmdb"], 32)
    (load,) = [o for o in (d.best, *d.alternatives) if o.strategy == "load_prefix"]
    lm = costs["lmdb"]
    expected = lm.latency_s + 2e-5 + 4096 / min(lm.bandwidth_bytes_per_s, 2e10) + TRUTH.time(16, 16)
    assert load.predicted_s == pytest.approx(expected, rel=1e-12)


class _IntoOnlyLmdb(LmdbTier):
    """An LMDB tier whose ``get_many`` fails: only the read loads make reaches its blocks."""

    def get_many(self, keys):  # type: ignore[no-untyped-def]
        raise AssertionError("calibration must time get_many_into, the read a load makes")


@pytest.mark.parametrize("readers", [1, 3])
def test_calibrate_tier_times_the_read_a_load_makes_over_its_readers(tmp_path, readers) -> None:
    with _IntoOnlyLmdb(tmp_path / "lmdb", 64 << 20) as tier:
        tier.put_many([("ns/keep", b"x" * 100)])
        cost = calibrate_tier(tier, 64 << 10, num_blocks=8, readers=readers)
        assert cost.name == "lmdb" and cost.bandwidth_bytes_per_s > 0 and cost.latency_s >= 0
        assert tier.usage().num_entries == 1 and tier.contains("ns/keep")
    with pytest.raises(ValueError, match="readers must be >= 1"):
        calibrate_tier(tier, 4096, num_blocks=2, readers=0)
