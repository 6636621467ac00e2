"""OnlineCostModel: exact decisions on hand-computed prices, exact EWMA steps, thread safety."""

from __future__ import annotations

import threading

import pytest

from cachestore.cost.model import (
    STRATEGY_LOAD_PREFIX,
    STRATEGY_OVERLAP,
    STRATEGY_RECOMPUTE,
    PrefillCost,
    TierCost,
)
from cachestore.cost.online import OnlineCostModel, default_priors, update_tier_cost
from cachestore.cost.outcomes import length_bucket

# 1 ms per token and nothing else; a 1000-byte block of 16 tokens. Every number below is
# checkable by hand.
LINEAR = PrefillCost(fixed_s=0.0, per_token_s=1e-3, attention_s=0.0)
HOST = TierCost("host", latency_s=1e-3, bandwidth_bytes_per_s=1e6)  # 1 ms per block
LMDB = TierCost("lmdb", latency_s=2e-3, bandwidth_bytes_per_s=5e5)  # 2 ms per block
S3 = TierCost("s3", latency_s=0.05, bandwidth_bytes_per_s=1e5)  # 10 ms per block


def model(alpha: float = 0.5) -> OnlineCostModel:
    return OnlineCostModel(
        {"host": HOST, "lmdb": LMDB, "s3": S3},
        LINEAR,
        block_bytes=1000,
        block_tokens=16,
        alpha=alpha,
    )


def test_long_prefix_on_fast_tier_loads_with_exact_prediction() -> None:
    d = model().decide(0, ["host"] * 4, 80)
    assert d.best.strategy == STRATEGY_LOAD_PREFIX
    assert (d.best.load_begin, d.best.load_end) == (0, 4)
    # 1 ms latency + 4 blocks x 1 ms, then 16 tokens x 1 ms.
    assert d.predicted_s == pytest.approx(0.001 + 0.004 + 0.016, rel=1e-12)
    by_strategy = {o.strategy: o.predicted_s for o in d.alternatives}
    assert by_strategy[STRATEGY_RECOMPUTE] == pytest.approx(0.080, rel=1e-12)
    # Best overlap: compute block 0 (16 ms) while blocks 1..3 load (1 + 3 ms), then 16 ms.
    assert by_strategy[STRATEGY_OVERLAP] == pytest.approx(0.032, rel=1e-12)


def test_lmdb_block_pays_both_hops_pipelined() -> None:
    d = model().decide(0, ["lmdb"] * 4, 80)
    assert d.best.strategy == STRATEGY_LOAD_PREFIX and d.best.load_end == 4
    # Latencies add (2 + 1 ms); the slower link (5e5 B/s) sets the rate: 4000 B -> 8 ms.
    assert d.predicted_s == pytest.approx(0.003 + 0.008 + 0.016, rel=1e-12)


def test_short_prefix_on_slow_tier_recomputes() -> None:
    d = model().decide(0, ["s3"], 32)
    assert d.best.strategy == STRATEGY_RECOMPUTE
    assert d.predicted_s == pytest.approx(0.032, rel=1e-12)
    (load,) = [o for o in d.alternatives if o.strategy == STRATEGY_LOAD_PREFIX]
    # 50 + 1 ms latency, 1000 B at 1e5 B/s = 10 ms, then 16 tokens.
    assert load.predicted_s == pytest.approx(0.051 + 0.010 + 0.016, rel=1e-12)


def test_gpu_hit_counts_as_context_and_mixed_sources() -> None:
    d = model().decide(2, ["host", "lmdb"], 64)
    # 32 tokens on the GPU; recompute the other 32 = 32 ms. Load both: host run (1 + 1 ms),
    # then lmdb run (3 + 2 ms), nothing left to compute.
    assert d.best.strategy == STRATEGY_LOAD_PREFIX and d.best.load_end == 2
    assert d.predicted_s == pytest.approx(0.002 + 0.005, rel=1e-12)
    recompute = [o for o in d.alternatives if o.strategy == STRATEGY_RECOMPUTE][0]
    assert recompute.predicted_s == pytest.approx(0.032, rel=1e-12)


def test_a_backlog_on_the_load_thread_turns_an_lmdb_load_into_recompute() -> None:
    """30 lmdb blocks queued ahead (3 ms + 30 x 2 ms = 63 ms at lmdb's price): loading the
    4 lmdb blocks (27 ms alone) now takes 90 ms, over the 80 ms of recomputing them."""
    assert model().decide(0, ["lmdb"] * 4, 80).best.strategy == STRATEGY_LOAD_PREFIX
    d = model().decide(0, ["lmdb"] * 4, 80, backlog={"lmdb": 30})
    assert d.best.strategy == STRATEGY_RECOMPUTE
    assert d.predicted_s == pytest.approx(0.080, rel=1e-12)
    assert d.backlog_s == pytest.approx(0.063, rel=1e-12)
    (load,) = [o for o in d.alternatives if o.strategy == STRATEGY_LOAD_PREFIX]
    assert load.predicted_s == pytest.approx(0.027 + 0.063, rel=1e-12)


def test_a_decision_shows_each_options_raw_price_and_the_ratio_that_ranked_it() -> None:
    """Behind 10 queued lmdb blocks (23 ms) loading 4 lmdb blocks is priced 50 ms against
    recompute's 80. One load measured at 3x its price: the next decision of that length
    recomputes, and says why in its own terms: load's raw price (unchanged, the cheaper)
    times 3 against recompute's times 1."""
    m, queued = model(), {"lmdb": 10}
    before = m.decide(0, ["lmdb"] * 4, 80, backlog=queued)
    assert before.best.strategy == STRATEGY_LOAD_PREFIX
    assert {r for _, _, r in before.priced()} == {1.0}  # nothing measured yet
    m.observe_outcome(STRATEGY_LOAD_PREFIX, 80, 0.050, 3 * 0.050)
    after = m.decide(0, ["lmdb"] * 4, 80, backlog=queued)
    assert after.best.strategy == STRATEGY_RECOMPUTE
    priced = {k: (price, r) for k, price, r in after.priced()}
    assert priced[STRATEGY_RECOMPUTE] == (pytest.approx(0.080, rel=1e-12), 1.0)
    assert priced[STRATEGY_LOAD_PREFIX] == (pytest.approx(0.050, rel=1e-12), pytest.approx(3.0))
    assert after.priced()[0][0] == STRATEGY_RECOMPUTE  # the chosen option first


def test_the_backlog_is_priced_at_the_tiers_learned_rate() -> None:
    m = model(alpha=1.0)
    assert m.backlog_seconds({"lmdb": 30, "s3": 1}) == pytest.approx(0.063 + 0.061, rel=1e-12)
    m.observe_transfer("lmdb", 4000, 0.002 + 0.004)  # lmdb turns out twice as fast: 1e6 B/s
    # Both hops now run at 1e6 B/s: 30 blocks take 3 ms + 30 ms.
    assert m.backlog_seconds({"lmdb": 30}) == pytest.approx(0.033, rel=1e-12)


def test_no_backlog_decides_exactly_as_before() -> None:
    plain = model().decide(0, ["lmdb"] * 4, 80)
    assert model().decide(0, ["lmdb"] * 4, 80, backlog=None) == plain
    assert model().decide(0, ["lmdb"] * 4, 80, backlog={}) == plain
    # Host blocks are not read by the load thread; a tier without a price is not priced.
    assert model().decide(0, ["lmdb"] * 4, 80, backlog={"host": 500, "redis": 9}) == plain
    assert plain.backlog_s == 0.0


def test_a_host_only_load_ignores_the_backlog() -> None:
    plain = model().decide(0, ["host"] * 4, 80)
    d = model().decide(0, ["host"] * 4, 80, backlog={"lmdb": 100})
    assert (d.best, d.alternatives) == (plain.best, plain.alternatives)
    assert d.backlog_s == pytest.approx(0.203, rel=1e-12)
    # A host block ahead of an lmdb one still loads; the lmdb block (5 ms + 31 ms queued) is
    # recomputed: 2 ms + 16 ms against 38 ms for both and 32 ms for neither.
    d = model().decide(2, ["host", "lmdb"], 64, backlog={"lmdb": 14})
    assert (d.best.strategy, d.best.load_begin, d.best.load_end) == (STRATEGY_LOAD_PREFIX, 0, 1)
    assert d.predicted_s == pytest.approx(0.018, rel=1e-12)


def test_decide_rejects_unknown_tier_and_oversized_chain() -> None:
    m = model()
    with pytest.raises(ValueError, match="redis"):
        m.decide(0, ["redis"], 32)
    with pytest.raises(ValueError, match="exceed"):
        m.decide(1, ["host", "host"], 40)
    with pytest.raises(ValueError):
        OnlineCostModel({}, LINEAR, 1000, 16, alpha=0.0)


def test_bandwidth_ewma_step_is_exact() -> None:
    m = model(alpha=0.5)
    # 10000 B predicted at 10 ms > 1 ms latency: bandwidth-dominated. Sample (6 - 1 ms) / 10000
    # = 5e-7 s/B; 1/B = 1e-6 + 0.5 * (5e-7 - 1e-6) = 7.5e-7 s/B.
    m.observe_transfer("host", 10_000, 0.006)
    host = m.tier_costs()["host"]
    assert host.bandwidth_bytes_per_s == pytest.approx(1 / 7.5e-7, rel=1e-12)
    assert host.latency_s == 1e-3
    # Faster than the latency alone: the whole time counts as copy: 0.5 ms / 10000 = 5e-8 s/B.
    m.observe_transfer("host", 10_000, 0.0005)
    assert m.tier_costs()["host"].bandwidth_bytes_per_s == pytest.approx(
        1 / (7.5e-7 + 0.5 * (5e-8 - 7.5e-7)), rel=1e-12
    )
    snap = m.snapshot()["tiers"]["host"]
    assert snap["num_samples"] == 2 and snap["prior_bandwidth_bytes_per_s"] == 1e6


def test_latency_ewma_step_is_exact() -> None:
    m = model(alpha=0.25)
    # 100 B predicted at 0.1 ms < 1 ms latency: latency-dominated; sample 3 ms - 0.1 ms.
    m.observe_transfer("host", 100, 0.003)
    host = m.tier_costs()["host"]
    assert host.latency_s == pytest.approx(1e-3 + 0.25 * (0.0029 - 1e-3), rel=1e-12)
    assert host.bandwidth_bytes_per_s == 1e6
    assert update_tier_cost(HOST, 0, 0.004, 0.5).latency_s == pytest.approx(0.0025, rel=1e-12)


def test_learned_bandwidth_changes_the_decision() -> None:
    m = model(alpha=1.0)
    assert m.decide(0, ["lmdb"] * 4, 80).best.strategy == STRATEGY_LOAD_PREFIX
    # The lmdb hop turns out to run at 1e4 B/s: 4 blocks now take 400 ms to load.
    m.observe_transfer("lmdb", 4000, 0.002 + 0.4)
    assert m.tier_costs()["lmdb"].bandwidth_bytes_per_s == pytest.approx(1e4, rel=1e-12)
    d = m.decide(0, ["lmdb"] * 4, 80)
    assert d.best.strategy == STRATEGY_RECOMPUTE
    assert m.snapshot()["decisions"] == {STRATEGY_LOAD_PREFIX: 1, STRATEGY_RECOMPUTE: 1}


def test_unknown_tier_starts_from_first_sample_and_bad_samples() -> None:
    m = model()
    m.observe_transfer("redis", 5000, 0.01)
    assert m.tier_costs()["redis"] == TierCost("redis", 0.0, 5e5)
    m.observe_transfer("host", 1000, 0.0)  # clock resolution: no information
    m.observe_prefill(16, 0, -1.0)
    assert m.snapshot()["ignored"] == {"transfers": 1, "prefills": 1, "outcomes": 0}
    assert m.tier_costs()["host"] == HOST
    with pytest.raises(ValueError):
        m.observe_transfer("host", -1, 0.1)
    with pytest.raises(ValueError):
        m.observe_prefill(-1, 0, 0.1)


def test_prefill_scale_ewma_and_its_effect_on_decisions() -> None:
    m = model(alpha=0.5)
    m.observe_prefill(100, 0, 0.2)  # twice the 100 ms prior: scale 1 + 0.5 * (2 - 1)
    assert m.snapshot()["prefill"]["scale"] == pytest.approx(1.5, rel=1e-12)
    assert m.prefill_cost().per_token_s == pytest.approx(1.5e-3, rel=1e-12)
    d = m.decide(0, ["s3"], 32)
    assert d.best.strategy == STRATEGY_RECOMPUTE
    assert d.predicted_s == pytest.approx(0.048, rel=1e-12)
    snap = m.snapshot()
    assert snap["predicted_saved_s"] == 0.0 and snap["prefill"]["num_samples"] == 1


def test_others_tokens_in_a_step_are_priced_without_its_fixed_part_and_learn_the_scale() -> None:
    m = OnlineCostModel(
        {"host": HOST},
        PrefillCost(fixed_s=5e-3, per_token_s=1e-4, attention_s=1e-8),
        block_bytes=1000,
        block_tokens=16,
        alpha=0.5,
    )
    # 200 tokens as one chunk from an empty context: 200 * 1e-4 + 1e-8 * 200 * 100, no 5 ms
    assert m.step_share_s(200) == pytest.approx(0.0202, rel=1e-12)
    assert m.step_share_s(0) == 0.0 and m.step_share_s(-3) == 0.0
    m.observe_prefill(100, 0, 2 * (5e-3 + 1e-2 + 5e-5))  # twice the price: scale 1.5
    assert m.step_share_s(200) == pytest.approx(1.5 * 0.0202, rel=1e-12)


def test_h200_prior_matches_design_figures() -> None:
    p = default_priors("h200-llama-3-8b")
    assert p.block_bytes == 2 << 20 and p.block_tokens == 16
    assert p.tier_costs["host"].bandwidth_bytes_per_s == 55.4e9
    assert p.prefill.time(16384) == pytest.approx(0.577, rel=1e-9)
    m = OnlineCostModel.from_priors(p)
    # DESIGN.md: a 16K reload from host (~40 ms) beats the 577 ms recompute by far.
    d = m.decide(0, ["host"] * 1024, 16384 + 16)
    assert d.best.strategy != STRATEGY_RECOMPUTE and d.predicted_s < 0.6 / 12
    assert default_priors("cpu").tier_costs["host"].bandwidth_bytes_per_s > 0
    with pytest.raises(ValueError, match="unknown cost prior"):
        default_priors("tpu")


def test_concurrent_observe_and_decide_lose_no_update() -> None:
    m = model(alpha=0.1)
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait()
            for _ in range(300):
                m.observe_transfer("host", 10_000, 0.006)
                m.observe_prefill(16, 0, 0.016)
                m.decide(0, ["host"] * 4, 80)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    snap = m.snapshot()
    assert snap["tiers"]["host"]["num_samples"] == 2400
    assert snap["prefill"]["num_samples"] == 2400 and snap["prefill"]["scale"] == 1.0
    assert sum(snap["decisions"].values()) == 2400
    # Identical samples: any interleaving gives the same value, the sequential one.
    expected = HOST
    for _ in range(2400):
        expected = update_tier_cost(expected, 10_000, 0.006, 0.1)
    assert m.tier_costs()["host"] == expected


def test_a_lower_tier_slower_than_its_calibration_is_priced_slow_within_three_loads() -> None:
    # LMDB calibrated at 5e6 B/s (0.2 ms per 1000-byte block) really reads at 1e5 B/s (10 ms per
    # block), the H200 case; a 0.25 ms/token prefill recomputes 30 blocks (480 tokens) in 120 ms.
    fast = TierCost("lmdb", latency_s=0.0, bandwidth_bytes_per_s=5e6)
    m = OnlineCostModel(
        {"host": TierCost("host", latency_s=0.0, bandwidth_bytes_per_s=1e9), "lmdb": fast},
        PrefillCost(fixed_s=0.0, per_token_s=2.5e-4, attention_s=0.0),
        block_bytes=1000,
        block_tokens=16,
        alpha=0.2,
    )

    def load_all_s() -> float:
        d = m.decide(0, ["lmdb"] * 30, 480)
        options = (d.best, *d.alternatives)
        return next(o for o in options if o.strategy == STRATEGY_LOAD_PREFIX).predicted_s

    assert load_all_s() == pytest.approx(30_000 / 5e6, rel=1e-6)
    for _ in range(3):
        m.observe_transfer("lmdb", 30_000, 0.3)  # 30 blocks in 300 ms: 1e5 B/s
    # Seconds per byte: 2e-7 -> 5.1e-6 (weight 1/2) -> 6.73e-6 (1/3) -> 7.55e-6 (1/4), within
    # 1.33x of the truth; an average of rates at 0.2 would still say 2.6e6 B/s (11.5 ms).
    assert m.tier_costs()["lmdb"].bandwidth_bytes_per_s == pytest.approx(1 / 7.55e-6, rel=0.01)
    # Loading all 30 blocks now prices at ~227 ms against 120 ms of recompute.
    assert load_all_s() == pytest.approx(30_000 * 7.55e-6, rel=0.01)
    assert m.decide(0, ["lmdb"] * 30, 480).best.strategy != STRATEGY_LOAD_PREFIX
    # The host tier keeps its steadier average: one slow sample weighs alpha.
    m.observe_transfer("host", 10_000, 1e-4)
    assert m.tier_costs()["host"].bandwidth_bytes_per_s == pytest.approx(
        1 / (1e-9 + 0.2 * (1e-8 - 1e-9)), rel=1e-9
    )


def test_a_load_shut_out_by_one_outlier_is_tried_again_though_recomputes_are_never_measured() -> (
    None
):
    """The H200 QA run with compressed blocks: the first reload met kernels not yet compiled
    (8.7x its price, kept as 4x), and every recompute chosen after it shared its steps with
    other prompts, so no outcome was measured to relax the load's ratio: 44 reused requests
    recomputed. Past three decisions at a length without a measured outcome, each decision
    that goes against the load the prices alone choose relaxes its ratio, so it is chosen
    again after a few; measured slow again, it loses again."""
    # 100 tokens, 6 blocks on a 1 ms + 1 ms/block host tier: load 7 ms + 4 tokens = 7.64 ms;
    # recompute 16 ms (2.09x: within the span where ratios choose, as the QA run's 37 / 76)
    prefill = PrefillCost(fixed_s=0.0, per_token_s=1.6e-4, attention_s=0.0)
    m = OnlineCostModel({"host": HOST}, prefill, block_bytes=1000, block_tokens=16, alpha=0.5)

    def decide() -> object:
        return m.decide(0, ["host"] * 6, 100, overlap=False).best.strategy

    d = m.decide(0, ["host"] * 6, 100, overlap=False)
    assert d.best.strategy == STRATEGY_LOAD_PREFIX
    assert d.predicted_s == pytest.approx(0.00764, rel=1e-9)
    m.observe_outcome(STRATEGY_LOAD_PREFIX, 100, d.predicted_s, 8.7 * d.predicted_s)  # kept 4x
    # recomputes whose outcomes are never observed: three without relaxing, then
    # 7.64 x (1 + 3 x 0.8^n) < 16 from n = 5 relaxed decisions on
    assert [decide() for _ in range(9)] == [STRATEGY_RECOMPUTE] * 8 + [STRATEGY_LOAD_PREFIX]
    # measured slow again: back to 4x, and recompute again
    m.observe_outcome(STRATEGY_LOAD_PREFIX, 100, d.predicted_s, 10 * d.predicted_s)
    assert decide() == STRATEGY_RECOMPUTE
    assert m.snapshot()["decisions"][STRATEGY_RECOMPUTE] == 9


def test_decisions_whose_outcomes_are_measured_relax_no_faster_than_before() -> None:
    """Where the plans chosen instead are measured, their outcomes relax the pessimistic
    ratio (one step each) and the decisions between them add nothing."""
    prefill = PrefillCost(fixed_s=0.0, per_token_s=1.6e-4, attention_s=0.0)
    m = OnlineCostModel({"host": HOST}, prefill, block_bytes=1000, block_tokens=16, alpha=0.5)
    d = m.decide(0, ["host"] * 6, 100, overlap=False)
    m.observe_outcome(STRATEGY_LOAD_PREFIX, 100, d.predicted_s, 8.7 * d.predicted_s)
    for _ in range(3):  # each recompute measured as priced: one relaxation each
        r = m.decide(0, ["host"] * 6, 100, overlap=False)
        assert r.best.strategy == STRATEGY_RECOMPUTE
        m.observe_outcome(STRATEGY_RECOMPUTE, 100, r.predicted_s, r.predicted_s)
    ratios = m.snapshot()["outcome_ratios"][STRATEGY_LOAD_PREFIX]
    assert ratios["3"] == pytest.approx(1 + 3 * 0.8**3)


def test_a_transfer_faster_than_any_hop_is_ignored_not_learned() -> None:
    """Copies timed by events that span nothing read as ~1 ns: 36 such samples once moved a
    host hop of 50 GB/s to 5.6 TB/s. They are counted as ignored; a fast real one still
    teaches."""
    gib = 1 << 30
    m = OnlineCostModel(
        {"host": TierCost("host", latency_s=1e-5, bandwidth_bytes_per_s=5e10)},
        LINEAR,
        block_bytes=2 << 20,
        block_tokens=16,
        alpha=0.2,
    )
    for _ in range(36):
        m.observe_transfer("host", gib // 2, 1e-9)
    assert m.tier_costs()["host"].bandwidth_bytes_per_s == 5e10
    assert m.snapshot()["ignored"]["transfers"] == 36
    m.observe_transfer("host", gib, gib / 2e11)  # 200 GB/s: fast, but a hop can be
    assert m.tier_costs()["host"].bandwidth_bytes_per_s > 5.5e10
    assert m.snapshot()["ignored"]["transfers"] == 36


def test_a_split_measured_faster_than_the_load_keeps_running_at_that_length() -> None:
    """An H100's 16K-token reload from LMDB (twenty-third session's ``bench.offload``): the
    forced split took 158 ms, load-all 174, recompute 526; ``decision: cost`` loaded all six
    times (1.06x the best). Here the model prices them from an H100-like prefill curve and an
    LMDB read rate, each served request teaches its measured time, and the six requests of one
    bench length must come out within 1.05x of the best plan: the split, measured, keeps
    running (it was taken once, then lost to the load on the 15% margin for good)."""
    prefill = PrefillCost(fixed_s=5.4e-3, per_token_s=2.22e-5, attention_s=1.17e-9)
    costs = {
        "host": TierCost("host", 1e-5, 50e9),
        "lmdb": TierCost("lmdb", 1e-4, 12e9),
    }
    m = OnlineCostModel(costs, prefill, block_bytes=2 << 20, block_tokens=16)
    took = {STRATEGY_LOAD_PREFIX: 0.174, STRATEGY_OVERLAP: 0.158, STRATEGY_RECOMPUTE: 0.526}
    served = []
    for _ in range(6):
        d = m.decide(0, ["lmdb"] * 1024, 16384 + 16)
        served.append(took[d.best.strategy])
        m.observe_outcome(d.best.strategy, 16384 + 16, d.predicted_s, served[-1])
    assert sorted(served)[len(served) // 2] <= 1.05 * min(took.values())
    assert served.count(took[STRATEGY_OVERLAP]) >= 5
    # and a split measured slower than the load gives way to it
    took[STRATEGY_OVERLAP] = 0.200
    for _ in range(2):
        d = m.decide(0, ["lmdb"] * 1024, 16384 + 16)
        m.observe_outcome(d.best.strategy, 16384 + 16, d.predicted_s, took[d.best.strategy])
    assert m.decide(0, ["lmdb"] * 1024, 16384 + 16).best.strategy == STRATEGY_LOAD_PREFIX


def test_a_split_never_taken_is_tried_once_where_the_load_measures_far_above_its_price() -> None:
    """The H100's 16K row as it happened: ``cost`` loaded all six times, never splitting. One
    reading that fits: LMDB priced at a page-cache read rate (here 40 GB/s) puts load-all at
    ~61 ms and the split ~11% under it (inside the 15% margin), while the load takes 174 ms.
    The load's ratio (2.8) says the prices are off by more than the margin, so the split is
    tried once, measured (158 ms), and then runs: the six requests' median is the split's."""
    prefill = PrefillCost(fixed_s=5.4e-3, per_token_s=2.22e-5, attention_s=1.17e-9)
    costs = {"host": TierCost("host", 1e-5, 50e9), "lmdb": TierCost("lmdb", 1e-4, 40e9)}
    m = OnlineCostModel(costs, prefill, block_bytes=2 << 20, block_tokens=16)
    took = {STRATEGY_LOAD_PREFIX: 0.174, STRATEGY_OVERLAP: 0.158, STRATEGY_RECOMPUTE: 0.526}
    first = m.decide(0, ["lmdb"] * 1024, 16384 + 16)
    split = next(o for o in first.alternatives if o.strategy == STRATEGY_OVERLAP)
    assert first.best.strategy == STRATEGY_LOAD_PREFIX  # on raw prices, inside the margin
    assert split.predicted_s < first.predicted_s and split.predicted_s > 0.85 * first.predicted_s
    served = []
    d = first
    for _ in range(6):
        served.append(took[d.best.strategy])
        m.observe_outcome(d.best.strategy, 16384 + 16, d.predicted_s, served[-1])
        d = m.decide(0, ["lmdb"] * 1024, 16384 + 16)
    assert served[0] == took[STRATEGY_LOAD_PREFIX] and served[1] == took[STRATEGY_OVERLAP]
    assert sorted(served)[len(served) // 2] <= 1.05 * min(took.values())
    assert m.snapshot()["explored_splits"] == [length_bucket(16384 + 16, 16)]
