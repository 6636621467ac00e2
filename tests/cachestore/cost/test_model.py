"""Exact pricing of cachestore/cost/model.py: reload, recompute, and the split decision."""

from __future__ import annotations

import pytest

from cachestore.cost.model import (
    DEFAULT_TIER_COSTS,
    LLAMA3_8B_H200_PREFILL,
    MODEL_PROFILES,
    STRATEGY_LOAD_PREFIX,
    STRATEGY_OVERLAP,
    STRATEGY_RECOMPUTE,
    Decision,
    Option,
    PrefillCost,
    PrefillSample,
    TierCost,
    choose_split,
    get_model_profile,
    hops_to_gpu,
    recompute_time,
    reload_time,
)

# A linear prefill (1 ms per token, nothing else) keeps every expected number hand-checkable.
LINEAR = PrefillCost(fixed_s=0.0, per_token_s=1e-3, attention_s=0.0)
FAST = TierCost("fast", latency_s=5e-3, bandwidth_bytes_per_s=1e5)  # 100 B block: 1 ms
SLOW = TierCost("slow", latency_s=0.0, bandwidth_bytes_per_s=100.0)  # 100 B block: 1 s


def test_prior_reproduces_design_prefill_figures() -> None:
    p = LLAMA3_8B_H200_PREFILL
    assert p.time(1024) == pytest.approx(0.031, rel=1e-12)
    assert p.time(4096) == pytest.approx(0.120, rel=1e-12)
    assert p.time(16384) == pytest.approx(0.577, rel=1e-12)
    # DESIGN.md: recompute costs about 30 us per token at 4K context (beyond the launch cost).
    per_token = (p.time(16, 4096) - p.fixed_s) / 16
    assert 25e-6 < per_token < 35e-6


def test_fit_recovers_known_coefficients_with_context() -> None:
    truth = PrefillCost(fixed_s=0.002, per_token_s=1e-5, attention_s=3e-9)
    samples = [
        PrefillSample(n, c, truth.time(n, c))
        for n, c in [(16, 0), (512, 0), (512, 4096), (2048, 1024), (8192, 0)]
    ]
    fitted = PrefillCost.fit(samples)
    assert fitted.fixed_s == pytest.approx(0.002, rel=1e-9)
    assert fitted.per_token_s == pytest.approx(1e-5, rel=1e-9)
    assert fitted.attention_s == pytest.approx(3e-9, rel=1e-9)


def test_fit_rejects_underdetermined_samples() -> None:
    with pytest.raises(ValueError, match="need 3"):
        PrefillCost.fit([PrefillSample(16, 0, 0.01), PrefillSample(32, 0, 0.02)])


def test_recompute_time_formula_and_edges() -> None:
    p = PrefillCost(fixed_s=0.5, per_token_s=0.25, attention_s=0.125)
    # 0.5 + 0.25*4 + 0.125*4*(10 + 2) = 7.5
    assert recompute_time(4, 10, p) == 7.5
    assert recompute_time(0, 10, p) == 0.0
    with pytest.raises(ValueError):
        recompute_time(-1, 0, p)


def test_reload_time_pipelined_hops() -> None:
    hops = hops_to_gpu("redis", DEFAULT_TIER_COSTS)
    assert [h.name for h in hops] == ["redis", "host"]
    # Latencies add (500 us + 10 us); the slowest link (Redis, 2.5 GB/s) sets the rate.
    assert reload_time(10, 2 << 20, hops) == pytest.approx(
        510e-6 + 10 * (2 << 20) / 2.5e9, rel=1e-15
    )
    assert reload_time(0, 2 << 20, hops) == 0.0
    assert reload_time(5, 2 << 20, ()) == 0.0
    assert hops_to_gpu("gpu", DEFAULT_TIER_COSTS) == ()
    assert [h.name for h in hops_to_gpu("host", DEFAULT_TIER_COSTS)] == ["host"]
    with pytest.raises(ValueError, match="no cost for tier"):
        hops_to_gpu("tape", DEFAULT_TIER_COSTS)
    with pytest.raises(ValueError):
        TierCost("x", 0.0, 0.0)


def test_model_profiles() -> None:
    assert MODEL_PROFILES["llama-3-8b"].kv_bytes_per_token == 32 * 8 * 128 * 2 * 2
    assert get_model_profile("qwen2.5-7b").block_bytes(16) == 57344 * 16
    assert get_model_profile("llama-3-70b").kv_bytes_per_token == 327680
    with pytest.raises(ValueError, match="unknown model profile"):
        get_model_profile("gpt-5")


def test_choose_split_prefers_overlap_when_compute_hides_load_latency() -> None:
    # 100-token prompt, 8 cached blocks of 10 tokens (100 B) on FAST: load k blocks costs
    # 5 + k ms; recompute costs 1 ms per token.
    d = choose_split([(FAST,)] * 8, 10, 100, 100, LINEAR)
    # Load all 8 then compute 20 tokens: 13 + 20 = 33 ms. Compute block 0 (10 ms) while blocks
    # 1..7 load (12 ms), then 20 tokens: 32 ms. Recompute all: 100 ms.
    assert d.best == Option(STRATEGY_OVERLAP, 1, 8, pytest.approx(0.032))
    assert d.predicted_s == pytest.approx(0.032)
    by_strategy = {(o.strategy, o.load_begin, o.load_end): o.predicted_s for o in d.alternatives}
    assert by_strategy == {
        (STRATEGY_RECOMPUTE, 0, 0): pytest.approx(0.100),
        (STRATEGY_LOAD_PREFIX, 0, 8): pytest.approx(0.033),
    }


def test_choose_split_recomputes_when_the_tier_is_slow() -> None:
    d = choose_split([(SLOW,)] * 3, 10, 100, 40, LINEAR)
    assert d.best.strategy == STRATEGY_RECOMPUTE
    assert d.best.num_load_blocks == 0
    assert d.predicted_s == pytest.approx(0.040)


def test_choose_split_loads_fast_head_and_recomputes_slow_tail() -> None:
    # Blocks 0-1 on FAST, 2-3 on SLOW: load [0, 2) (5 + 2 = 7 ms) then compute 20 tokens.
    d = choose_split([(FAST,), (FAST,), (SLOW,), (SLOW,)], 10, 100, 40, LINEAR)
    assert (d.best.strategy, d.best.load_begin, d.best.load_end) == (STRATEGY_LOAD_PREFIX, 0, 2)
    assert d.predicted_s == pytest.approx(0.027)


def test_choose_split_ties_prefer_fewer_loaded_blocks() -> None:
    # Loading one block costs exactly its 10 ms of compute: recompute wins the tie.
    even = TierCost("even", latency_s=0.0, bandwidth_bytes_per_s=1e4)
    d = choose_split([(even,)], 10, 100, 10, LINEAR)
    assert d.best.strategy == STRATEGY_RECOMPUTE


def test_choose_split_rejects_more_cached_blocks_than_the_prompt() -> None:
    with pytest.raises(ValueError, match="exceed the prompt"):
        choose_split([(FAST,)] * 3, 10, 100, 25, LINEAR)
    with pytest.raises(ValueError):
        choose_split([], 0, 100, 25, LINEAR)


def test_choose_split_counts_gpu_computed_tokens_as_context() -> None:
    p = PrefillCost(fixed_s=0.0, per_token_s=0.0, attention_s=1e-3)
    d = choose_split([], 10, 100, 30, p, computed_tokens=20)
    # 10 new tokens over 20 cached: 1e-3 * 10 * (20 + 5) = 0.25 s.
    assert d.best == Option(STRATEGY_RECOMPUTE, 0, 0, pytest.approx(0.25))
    assert d.alternatives == ()


def test_pipelined_host_loads_cost_the_longer_of_load_and_rest() -> None:
    """Loads landing layer by layer under the forward: load [0, k) costs
    max(load, rest) + min(load, rest) / layers, only for the leading pipelined blocks."""
    from cachestore.cost.model import (
        STRATEGY_LOAD_PREFIX,
        STRATEGY_OVERLAP,
        PrefillCost,
        TierCost,
        choose_split,
    )

    prefill = PrefillCost(0.0, 1e-3, 0.0)  # 1 ms per new token, no context term
    host = (TierCost("host", 0.0, 2e6),)  # 2 MB/s: a 4096-byte block takes 2.048 ms
    plain = choose_split([host] * 4, 4, 4096, 20, prefill)
    piped = choose_split([host] * 4, 4, 4096, 20, prefill, pipelined_blocks=4, num_layers=8)
    load_all = next(
        o
        for o in (plain.best, *plain.alternatives)
        if o.strategy == STRATEGY_LOAD_PREFIX and o.load_end == 4
    )
    assert abs(load_all.predicted_s - (4 * 2.048e-3 + 4e-3)) < 1e-9  # load, then the rest
    assert plain.best.strategy == STRATEGY_OVERLAP  # compute a block while three load: 10.1 ms
    assert piped.best.strategy == STRATEGY_LOAD_PREFIX and piped.best.load_end == 4
    assert abs(piped.best.predicted_s - (4 * 2.048e-3 + 4e-3 / 8)) < 1e-9
    only_two = choose_split([host] * 4, 4, 4096, 20, prefill, pipelined_blocks=2, num_layers=8)
    assert only_two.best.predicted_s >= piped.best.predicted_s
    with pytest.raises(ValueError):
        choose_split([host] * 4, 4, 4096, 20, prefill, pipelined_blocks=2, num_layers=0)


def test_overlap_must_win_by_the_margin() -> None:
    """Same prompt as the overlap test: overlap (32 ms) beats loading all (33 ms) by 3%, so a
    10% margin keeps load_prefix; a 100 ms recompute vs a 32 ms overlap passes any margin."""
    d = choose_split([(FAST,)] * 8, 10, 100, 100, LINEAR, overlap_margin=0.1)
    assert (d.best.strategy, d.best.load_end) == (STRATEGY_LOAD_PREFIX, 8)
    assert any(o.strategy == STRATEGY_OVERLAP for o in d.alternatives)
    assert (
        choose_split([(FAST,)] * 8, 10, 100, 100, LINEAR, overlap_margin=0.02).best.strategy
        == STRATEGY_OVERLAP
    )
    with pytest.raises(ValueError):
        choose_split([(FAST,)] * 8, 10, 100, 100, LINEAR, overlap_margin=1.0)


def _options(d: Decision) -> dict[tuple[str, int, int], float]:
    """Every option of a decision by (strategy, load_begin, load_end) -> predicted seconds."""
    return {
        (o.strategy, o.load_begin, o.load_end): o.predicted_s for o in (d.best, *d.alternatives)
    }


def test_a_load_backlog_delays_every_queued_load_until_a_split_or_recompute_wins() -> None:
    """The overlap test's prompt (8 FAST blocks, 100 tokens) behind queued reads: each load
    and each overlap's tail lands that much later; recompute does not move."""
    # 50 ms queued: load all 13 + 50 + 20 = 83 ms; the best split computes 5 blocks (50 ms)
    # while 3 load (5 + 3 + 50 = 58 ms), then 20 tokens: 78 ms.
    d = choose_split([(FAST,)] * 8, 10, 100, 100, LINEAR, backlog_s=0.050)
    assert d.best == Option(STRATEGY_OVERLAP, 5, 8, pytest.approx(0.078))
    assert _options(d) == {
        (STRATEGY_OVERLAP, 5, 8): pytest.approx(0.078),
        (STRATEGY_RECOMPUTE, 0, 0): pytest.approx(0.100),
        (STRATEGY_LOAD_PREFIX, 0, 8): pytest.approx(0.083),
    }
    assert d.backlog_s == 0.050
    # 100 ms queued: every load or split costs more than computing the 100 tokens.
    d = choose_split([(FAST,)] * 8, 10, 100, 100, LINEAR, backlog_s=0.100)
    assert d.best == Option(STRATEGY_RECOMPUTE, 0, 0, pytest.approx(0.100))
    assert _options(d)[(STRATEGY_LOAD_PREFIX, 0, 8)] == pytest.approx(0.133)


def test_no_backlog_prices_exactly_as_before() -> None:
    plain = choose_split([(FAST,)] * 8, 10, 100, 100, LINEAR)
    assert choose_split([(FAST,)] * 8, 10, 100, 100, LINEAR, backlog_s=0.0) == plain
    zero = choose_split([(FAST,)] * 8, 10, 100, 100, LINEAR, backlog_s=0.0, queued=[True] * 8)
    assert zero == plain and zero.backlog_s == 0.0


def test_a_backlog_leaves_loads_of_blocks_off_the_load_thread_alone() -> None:
    plain = choose_split([(FAST,)] * 8, 10, 100, 100, LINEAR)
    host = choose_split([(FAST,)] * 8, 10, 100, 100, LINEAR, backlog_s=1.0, queued=[False] * 8)
    assert (host.best, host.alternatives) == (plain.best, plain.alternatives)
    # Host blocks ahead of the queued ones: loading only them is not delayed (5 + 4 + 60 ms);
    # every tail holds a queued block, so every split is.
    head = choose_split(
        [(FAST,)] * 8, 10, 100, 100, LINEAR, backlog_s=0.050, queued=[False] * 4 + [True] * 4
    )
    assert head.best == Option(STRATEGY_LOAD_PREFIX, 0, 4, pytest.approx(0.069))
    assert _options(head)[(STRATEGY_OVERLAP, 5, 8)] == pytest.approx(0.078)
    # Queued blocks ahead of host ones: a split whose tail is all host loads at once: compute
    # 4 blocks (40 ms) while 4 load (9 ms), then 20 tokens.
    tail = choose_split(
        [(FAST,)] * 8, 10, 100, 100, LINEAR, backlog_s=0.050, queued=[True] * 4 + [False] * 4
    )
    assert tail.best == Option(STRATEGY_OVERLAP, 4, 8, pytest.approx(0.060))
    assert _options(tail)[(STRATEGY_LOAD_PREFIX, 0, 8)] == pytest.approx(0.083)


def test_choose_split_rejects_a_bad_backlog() -> None:
    with pytest.raises(ValueError, match="backlog_s"):
        choose_split([(FAST,)] * 2, 10, 100, 30, LINEAR, backlog_s=-1.0)
    with pytest.raises(ValueError, match="backlog_s"):
        choose_split([(FAST,)] * 2, 10, 100, 30, LINEAR, backlog_s=float("nan"))
    with pytest.raises(ValueError, match="queued has 1 entries for 2"):
        choose_split([(FAST,)] * 2, 10, 100, 30, LINEAR, backlog_s=0.1, queued=[True])
