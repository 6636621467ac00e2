"""A noisy start-up calibration must not turn reuse off: impossible fits are rejected, the
model loads what a tier holds until it trusts itself, and live timings correct the per-token
slope within a few requests."""

from __future__ import annotations

import logging

import pytest

from cachestore.cost.calibration import calibrate, calibrate_prefill_checked
from cachestore.cost.checks import check_prefill, check_tier
from cachestore.cost.model import (
    STRATEGY_LOAD_PREFIX,
    STRATEGY_OVERLAP,
    STRATEGY_RECOMPUTE,
    Option,
    PrefillCost,
    PrefillSample,
    TierCost,
    reload_time,
)
from cachestore.cost.online import OnlineCostModel, default_priors

BLOCK_TOKENS = 16
BLOCK_BYTES = 64 << 10  # the demo model's block
# The machine as it really is: 5 ms + 30 us a token, LMDB at 1 GB/s, the host hop at 5 GB/s.
TRUE_PREFILL = PrefillCost(fixed_s=5e-3, per_token_s=30e-6, attention_s=1e-9)
TRUE_LMDB = TierCost("lmdb", 50e-6, 1.0e9)
TRUE_HOST = TierCost("host", 5e-6, 5.0e9)
# What one busy start-up measured: 81.84 ms whatever the length.
FLAT = PrefillCost(fixed_s=81.84e-3, per_token_s=0.0, attention_s=0.0)
SIZES = ((32, 0), (128, 0), (256, 0), (64, 192), (32, 128))


def flat_prefill(n: int, c: int) -> float:
    return 81.84e-3 + 1e-7 * (n % 3)  # a stall that drowns the length


def true_prefill(n: int, c: int) -> float:
    return TRUE_PREFILL.time(n, c)


def samples_of(cost: PrefillCost) -> list[PrefillSample]:
    return [PrefillSample(n, c, cost.time(n, c)) for n, c in SIZES]


# -- rejecting impossible calibrations ---------------------------------------------------


def test_check_prefill_accepts_a_real_fit() -> None:
    assert check_prefill(TRUE_PREFILL, samples_of(TRUE_PREFILL)) is None
    assert (
        check_prefill(default_priors("cpu").prefill, samples_of(default_priors("cpu").prefill))
        is None
    )


@pytest.mark.parametrize(
    ("cost", "match"),
    [
        (FLAT, "zero per-token cost"),
        (PrefillCost(81.84e-3, 0.5e-6, 0.0), "flat fit"),  # 0.13 ms of 82 ms grows with length
        (PrefillCost(5e-3, -1e-6, 0.0), "finite and >= 0"),
        (PrefillCost(float("nan"), 30e-6, 0.0), "finite and >= 0"),
        (PrefillCost(3.0, 30e-3, 0.0), "fixed cost"),
        (PrefillCost(5e-3, 0.2, 0.0), "per-token cost"),
    ],
)
def test_check_prefill_rejects_impossible_fits(cost: PrefillCost, match: str) -> None:
    reason = check_prefill(cost, samples_of(cost))
    assert reason is not None and match in reason


def test_check_prefill_rejects_wild_residuals_and_timings_out_of_bounds() -> None:
    noisy = [
        PrefillSample(n, c, t * (3.0 if i % 2 else 0.3))
        for i, (n, c, t) in enumerate(
            (s.num_tokens, s.context_tokens, s.seconds) for s in samples_of(TRUE_PREFILL)
        )
    ]
    assert "residuals" in (check_prefill(TRUE_PREFILL, noisy) or "")
    slow = [*samples_of(TRUE_PREFILL), PrefillSample(256, 0, 90.0)]
    assert "over 60 s" in (check_prefill(TRUE_PREFILL, slow) or "")


def test_check_tier_bounds() -> None:
    assert check_tier(TRUE_LMDB) is None
    assert "bandwidth" in (check_tier(TierCost("lmdb", 0.0, 10.0)) or "")
    assert "bandwidth" in (check_tier(TierCost("lmdb", 0.0, 1e15)) or "")
    assert "latency" in (check_tier(TierCost("lmdb", 5.0, 1e9)) or "")


def test_checked_calibration_retries_then_falls_back_to_the_prior(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = []

    def stalled_once(n: int, c: int) -> float:  # the first attempt stalls on every size
        calls.append((n, c))
        return flat_prefill(n, c) if len(calls) <= 1 + 2 * len(SIZES) else true_prefill(n, c)

    ok = calibrate_prefill_checked(stalled_once, SIZES, progress=False)
    assert ok.trusted and ok.cost.per_token_s == pytest.approx(30e-6, rel=0.05)
    prior = default_priors("cpu").prefill
    with caplog.at_level(logging.WARNING, logger="cachestore.cost.calibration"):
        bad = calibrate_prefill_checked(
            flat_prefill, SIZES, fallback=prior, attempts=2, progress=False
        )
    assert (bad.cost, bad.trusted) == (prior, False) and "per-token" in (bad.reason or "")
    assert sum("/2 rejected" in r.getMessage() for r in caplog.records) == 2
    no_prior = calibrate_prefill_checked(flat_prefill, SIZES, attempts=1, progress=False)
    assert not no_prior.trusted
    with pytest.raises(ValueError, match="attempts"):
        calibrate_prefill_checked(true_prefill, SIZES, attempts=0)


def test_calibrate_rejects_an_impossible_tier_measurement() -> None:
    priors = default_priors("cpu")
    model = calibrate(
        [],
        BLOCK_BYTES,
        BLOCK_TOKENS,
        host_to_gpu=lambda n: 10.0 + n,
        priors=priors,
        progress=False,
        num_blocks=4,
    )
    snap = model.snapshot()["tiers"]["host"]
    assert snap["latency_s"] == priors.tier_costs["host"].latency_s and not snap["trusted"]
    # An untrusted tier learns fast: its first sample weighs 1/2, not alpha = 0.2.
    model.observe_transfer("host", 10 << 20, 1e-3)
    bw = priors.tier_costs["host"].bandwidth_bytes_per_s
    per_byte = 1 / bw + 0.5 * ((1e-3 - 5e-6) / (10 << 20) - 1 / bw)
    assert model.tier_costs()["host"].bandwidth_bytes_per_s == pytest.approx(1 / per_byte, rel=1e-9)


def test_a_flat_curve_is_untrusted_whoever_passes_it_in() -> None:
    m = OnlineCostModel({"lmdb": TRUE_LMDB, "host": TRUE_HOST}, FLAT, BLOCK_BYTES, BLOCK_TOKENS)
    assert not m.trusted()
    d = m.decide(0, ["lmdb"] * 4, 80)
    assert d.best.strategy == STRATEGY_LOAD_PREFIX and d.best.load_end == 4
    assert any(o.strategy == STRATEGY_RECOMPUTE for o in d.alternatives)


# -- correcting online --------------------------------------------------------------------


def true_time(option: Option, prompt: int, num_cached: int) -> float:
    """What ``option`` really costs on this machine (no GPU hit)."""
    hops = (TRUE_LMDB, TRUE_HOST)
    cached_tokens = num_cached * BLOCK_TOKENS
    if option.strategy == STRATEGY_RECOMPUTE:
        return TRUE_PREFILL.time(prompt, 0)
    if option.strategy == STRATEGY_OVERLAP:
        m = option.load_begin
        head = TRUE_PREFILL.time(m * BLOCK_TOKENS, 0)
        return max(head, reload_time(num_cached - m, BLOCK_BYTES, hops)) + TRUE_PREFILL.time(
            prompt - cached_tokens, cached_tokens
        )
    k = option.load_end * BLOCK_TOKENS
    return reload_time(option.load_end, BLOCK_BYTES, hops) + TRUE_PREFILL.time(prompt - k, k)


def serve(model: OnlineCostModel, prompt: int, num_cached: int) -> Option:
    """One request: decide, then feed the model what the engine would measure."""
    d = model.decide(0, ["lmdb"] * num_cached, prompt)
    loaded = d.best.load_end if d.best.strategy == STRATEGY_LOAD_PREFIX else 0
    if loaded:
        nbytes = loaded * BLOCK_BYTES
        model.observe_transfer("lmdb", nbytes, reload_time(loaded, BLOCK_BYTES, (TRUE_LMDB,)))
        model.observe_transfer("host", nbytes, reload_time(loaded, BLOCK_BYTES, (TRUE_HOST,)))
    done = loaded * BLOCK_TOKENS
    model.observe_prefill(prompt - done, done, TRUE_PREFILL.time(prompt - done, done))
    return d.best


# Multi-turn traffic: a cached conversation (blocks in LMDB) plus a new turn of varied length.
REQUESTS = [(60, 40), (40, 200), (90, 72), (24, 300), (120, 18), (8, 500), (3, 30), (1, 700)]


def test_zero_cost_calibration_loads_within_five_requests() -> None:
    priors = default_priors("cpu")
    priors = type(priors)(priors.name, {**priors.tier_costs}, priors.prefill, BLOCK_BYTES)
    model = calibrate(
        [],
        BLOCK_BYTES,
        BLOCK_TOKENS,
        flat_prefill,
        priors=priors,
        prefill_sizes=SIZES,
        progress=False,
    )
    assert not model.trusted()
    for i, (num_cached, new) in enumerate(REQUESTS):
        prompt = num_cached * BLOCK_TOKENS + new
        chosen = serve(model, prompt, num_cached)
        d_truth = OnlineCostModel(
            {"lmdb": TRUE_LMDB, "host": TRUE_HOST}, TRUE_PREFILL, BLOCK_BYTES, BLOCK_TOKENS
        ).decide(0, ["lmdb"] * num_cached, prompt)
        best = true_time(d_truth.best, prompt, num_cached)
        # Within 5% of the best this machine could do, from the first request on (loading
        # what LMDB holds), and on its own judgement from the 5th on.
        assert true_time(chosen, prompt, num_cached) <= 1.05 * best, (i, chosen, d_truth.best)
        if i == 4:
            assert model.trusted()
            assert model.prefill_cost().per_token_s == pytest.approx(30e-6, rel=0.2)
    snap = model.snapshot()
    assert snap["prefill"]["trusted"] and snap["prefill"]["num_refits"] >= 1
    assert snap["decisions"].get(STRATEGY_LOAD_PREFIX, 0) >= 6


def test_trusted_but_wrong_slope_is_refit_from_live_samples() -> None:
    # Passes its checks, but prices a token at a tenth of what it costs: long prefixes look
    # cheaper to recompute than they are. A refit replaces it once live samples disagree.
    wrong = PrefillCost(fixed_s=1e-3, per_token_s=3e-6, attention_s=0.0)
    model = OnlineCostModel(
        {"lmdb": TRUE_LMDB, "host": TRUE_HOST}, wrong, BLOCK_BYTES, BLOCK_TOKENS
    )
    assert model.trusted()
    for n in (32, 512, 64, 1024, 128, 256, 48, 768) * 2:
        model.observe_prefill(n, 0, TRUE_PREFILL.time(n, 0))
    p = model.prefill_cost()
    assert model.snapshot()["prefill"]["num_refits"] == 1
    assert p.per_token_s == pytest.approx(30e-6, rel=0.2)
    assert p.fixed_s == pytest.approx(5e-3, rel=0.3)
