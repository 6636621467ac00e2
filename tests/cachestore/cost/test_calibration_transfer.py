"""Calibration of whole transfer paths (``fit_transfer``, ``calibrate_transfer``, ``calibrate``'s
``transfer_timers``) and the relative prefill fit: exact fits of synthetic timings, and a real
LMDB read path in a tmp dir."""

from __future__ import annotations

import os
import time

import pytest

from cachestore.cost.calibration import (
    TransferSample,
    calibrate,
    calibrate_transfer,
    fit_prefill_nonnegative,
    fit_transfer,
)
from cachestore.cost.model import PrefillCost, PrefillSample, TierCost
from cachestore.cost.online import CostPriors
from tiers.lmdb import LmdbTier

TRUTH = PrefillCost(fixed_s=0.002, per_token_s=1e-5, attention_s=3e-9)


def _samples(
    latency: float, bandwidth: float, block_bytes: int, sizes: tuple[int, ...]
) -> list[TransferSample]:
    return [TransferSample(n, latency + n * block_bytes / bandwidth) for n in sizes]


def test_fit_transfer_recovers_latency_and_bandwidth_over_three_sizes() -> None:
    cost = fit_transfer(_samples(3e-3, 2e9, 1 << 20, (16, 64, 128)), 1 << 20, "lmdb")
    assert cost.name == "lmdb"
    assert cost.latency_s == pytest.approx(3e-3, rel=1e-9)
    assert cost.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-9)


def test_fit_transfer_least_squares_of_noisy_samples() -> None:
    # t = 1, 2.5, 3 s at 1, 2, 3 blocks: slope 1.0 s/block, intercept 1/6 s (by hand).
    samples = [TransferSample(1, 1.0), TransferSample(2, 2.5), TransferSample(3, 3.0)]
    cost = fit_transfer(samples, 1000, "x")
    assert cost.bandwidth_bytes_per_s == pytest.approx(1000.0, rel=1e-12)
    assert cost.latency_s == pytest.approx(1 / 6, rel=1e-12)


def test_fit_transfer_negative_intercept_refits_through_the_origin() -> None:
    # Free fit: slope 2, intercept -1; through the origin: sum(n t) / sum(n^2) = 16 / 10.
    samples = [TransferSample(1, 1.0), TransferSample(3, 5.0)]
    cost = fit_transfer(samples, 100, "x")
    assert cost.latency_s == 0.0
    assert cost.bandwidth_bytes_per_s == pytest.approx(100 / 1.6, rel=1e-12)


def test_fit_transfer_flat_times_take_the_largest_size() -> None:
    # Times do not grow (noise): B from the largest size, L from the smallest.
    samples = [TransferSample(2, 4.0), TransferSample(8, 4.0)]
    cost = fit_transfer(samples, 10, "x")
    assert cost.bandwidth_bytes_per_s == pytest.approx(8 * 10 / 4.0, rel=1e-12)
    assert cost.latency_s == pytest.approx(4.0 - 2 * 0.5, rel=1e-12)


@pytest.mark.parametrize(
    "samples, match",
    [
        ([TransferSample(4, 1.0), TransferSample(4, 2.0)], "distinct sizes"),
        ([TransferSample(0, 1.0), TransferSample(4, 2.0)], "sizes must be"),
        ([TransferSample(1, 0.0), TransferSample(4, 2.0)], "times > 0"),
    ],
)
def test_fit_transfer_rejects_what_cannot_be_fitted(
    samples: list[TransferSample], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        fit_transfer(samples, 100, "x")


def test_calibrate_transfer_warms_up_then_keeps_the_fastest_run_per_size() -> None:
    calls: list[int] = []
    slow_first = {16: True, 128: True}

    def load(n: int) -> float:
        calls.append(n)
        extra = 1.0 if slow_first.get(n) else 0.0  # the first run of a size is slow
        slow_first[n] = False
        return 1e-3 + n * 4096 / 1e9 + extra

    fit = calibrate_transfer(load, 4096, "lmdb", sizes=(128, 16, 16), repeats=3)
    assert calls == [16] + [16] * 3 + [128] * 3  # warm-up at the smallest, sizes deduplicated
    assert [s.num_blocks for s in fit.samples] == [16, 128]
    assert fit.samples[0].seconds == pytest.approx(1e-3 + 16 * 4096 / 1e9, rel=1e-12)
    assert fit.cost.latency_s == pytest.approx(1e-3, rel=1e-9)
    assert fit.cost.bandwidth_bytes_per_s == pytest.approx(1e9, rel=1e-9)
    assert fit.predict(256, 4096) == pytest.approx(1e-3 + 256 * 4096 / 1e9, rel=1e-9)
    with pytest.raises(ValueError, match="repeats"):
        calibrate_transfer(load, 4096, "lmdb", repeats=0)


def test_calibrate_transfer_through_a_real_lmdb_read_path(tmp_path) -> None:
    # The callback reads n real blocks and copies them out, as a load path would; a fixed
    # sleep per call must come out as latency, and more blocks must cost more. A sleep per
    # block (0.2 ms, ~50x the read) keeps the order of the two sizes robust on a loaded CI
    # machine, where scheduler jitter can exceed a 2 MB LMDB read.
    block = 64 << 10
    keys = [f"ns/{i:04x}" for i in range(32)]
    with LmdbTier(tmp_path / "lmdb", 16 << 20) as tier:
        tier.put_many([(k, os.urandom(block)) for k in keys])

        def load(n: int) -> float:
            t0 = time.perf_counter()
            time.sleep(0.004 + n * 2e-4)
            values = tier.get_many(keys[:n])
            assert all(v is not None and len(v) == block for v in values)
            return time.perf_counter() - t0

        fit = calibrate_transfer(load, block, "lmdb", sizes=(4, 32), repeats=3)
    assert [s.num_blocks for s in fit.samples] == [4, 32]
    assert fit.samples[1].seconds > fit.samples[0].seconds >= 0.004
    assert fit.cost.latency_s >= 0.003
    assert fit.cost.bandwidth_bytes_per_s > 0


def test_calibrate_uses_transfer_timers_and_keeps_priors_when_they_fail() -> None:
    prior = TierCost("redis", 5e-4, 2.5e9)
    priors = CostPriors("t", {"redis": prior}, TRUTH, block_bytes=4096)

    def broken(n: int) -> float:
        raise OSError("gone")

    model = calibrate(
        [],
        4096,
        16,
        priors=priors,
        progress=False,
        transfer_sizes=(8, 64),
        transfer_timers={"lmdb": lambda n: 2e-3 + n * 4096 / 5e8, "redis": broken},
    )
    costs = model.tier_costs()
    assert set(costs) == {"lmdb", "redis"}  # no host hop: lmdb is priced as the whole path
    assert costs["lmdb"].latency_s == pytest.approx(2e-3, rel=1e-9)
    assert costs["lmdb"].bandwidth_bytes_per_s == pytest.approx(5e8, rel=1e-9)
    assert costs["redis"] == prior
    d = model.decide(0, ["lmdb"] * 4, 80)
    (load_all,) = [
        o for o in (d.best, *d.alternatives) if o.strategy == "load_prefix" and o.load_end == 4
    ]
    assert load_all.predicted_s == pytest.approx(2e-3 + 4 * 4096 / 5e8 + TRUTH.time(16, 64))
    with pytest.raises(ValueError, match="no prior"):
        calibrate(
            [],
            4096,
            16,
            priors=CostPriors("t", {}, TRUTH, 4096),
            progress=False,
            transfer_timers={"s3": broken},
        )


def test_relative_prefill_fit_weighs_short_prefills_like_long_ones() -> None:
    # Exact data: both fits recover it.
    exact = [PrefillSample(n, c, TRUTH.time(n, c)) for n, c in ((16, 0), (512, 0), (2048, 1024))]
    for rel in (False, True):
        fit = fit_prefill_nonnegative(exact, relative=rel)
        assert fit.per_token_s == pytest.approx(TRUTH.per_token_s, rel=1e-6)
    # A long sample 20% off the curve: the absolute fit gives up the short ones' accuracy to it,
    # the relative one keeps them closer.
    noisy = [PrefillSample(n, 0, TRUTH.time(n, 0)) for n in (16, 32, 64, 128)]
    noisy.append(PrefillSample(4096, 0, 1.2 * TRUTH.time(4096, 0)))
    absolute = fit_prefill_nonnegative(noisy)
    relative = fit_prefill_nonnegative(noisy, relative=True)
    short_err = [abs(f.time(16, 0) / TRUTH.time(16, 0) - 1) for f in (absolute, relative)]
    assert short_err[1] < short_err[0]
    long_err = [
        abs(f.time(4096, 0) / (1.2 * TRUTH.time(4096, 0)) - 1) for f in (absolute, relative)
    ]
    assert long_err[0] < long_err[1]
    with pytest.raises(ValueError, match="> 0"):
        fit_prefill_nonnegative([*exact, PrefillSample(8, 0, 0.0)], relative=True)
