"""The analysis numbers against an independent, obviously correct replay, on the real traces.

The reference is a plain OrderedDict LRU written here from the simulation's definition
(docs/analyze.md): lookup the leading blocks, then touch every block in order.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from cachestore.analyze.simulate import TierSpec, lru_hierarchy, replay
from cachestore.analyze.stack_distance import COLD, lru_hit_curve, stack_distances
from cachestore.analyze.traces import Trace, read_trace, trace_from_requests

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"


def _trace(name: str) -> Trace:
    path = TRACES / f"{name}_trace.jsonl.gz"
    if not path.exists():
        pytest.skip(f"{path} absent (the Mooncake traces are vendored in tests/data/traces)")
    return read_trace(path)


@pytest.fixture(scope="module")
def conversation() -> Trace:
    return _trace("conversation")


@pytest.fixture(scope="module")
def synthetic() -> Trace:
    return _trace("synthetic")


def reference_lru(trace: Trace, capacity: int | None) -> tuple[int, int]:
    """(leading hit blocks, hit tokens) of one LRU cache, by direct replay."""
    ids, offs = trace.block_ids.tolist(), trace.offsets.tolist()
    cache: OrderedDict[int, None] = OrderedDict()
    hit_blocks = hit_tokens = 0
    for r in range(trace.num_requests):
        blocks = ids[offs[r] : offs[r + 1]]
        h = 0
        for b in blocks:
            if b not in cache:
                break
            h += 1
        hit_blocks += h
        hit_tokens += min(h * trace.block_tokens, int(trace.input_tokens[r]))
        for b in blocks:
            if b in cache:
                cache.move_to_end(b)
            else:
                cache[b] = None
                if capacity is not None and len(cache) > capacity:
                    cache.popitem(last=False)
    return hit_blocks, hit_tokens


@pytest.mark.parametrize("name,capacity", [("conversation", 20000), ("synthetic", 8000)])
def test_full_trace_equals_reference_replay(name: str, capacity: int) -> None:
    trace = _trace(name)
    curve = lru_hit_curve(trace, [capacity, trace.num_block_refs])
    ref_cap, ref_inf = reference_lru(trace, capacity), reference_lru(trace, None)
    assert (int(curve.hit_blocks[0]), int(curve.hit_tokens[0])) == ref_cap
    assert (int(curve.hit_blocks[1]), int(curve.hit_tokens[1])) == ref_inf
    assert stack_distances(trace).chained  # the vectorized path is the one checked


@pytest.mark.parametrize("capacity", [1, 7, 64, 500, 3000, None])
def test_prefix_curve_and_replay_equal_reference(
    conversation: Trace, synthetic: Trace, capacity: int | None
) -> None:
    for trace in (conversation.head(1500), synthetic.head(600)):
        expected = reference_lru(trace, capacity)
        cap = trace.num_block_refs if capacity is None else capacity
        curve = lru_hit_curve(trace, [cap])
        assert (int(curve.hit_blocks[0]), int(curve.hit_tokens[0])) == expected
        res = replay(trace, [TierSpec("host", capacity)])
        hit_tokens = int(np.minimum(res.hit_blocks * trace.block_tokens, trace.input_tokens).sum())
        assert (int(res.hit_blocks.sum()), hit_tokens) == expected


def test_vectorized_distances_equal_fenwick_pass(conversation: Trace, synthetic: Trace) -> None:
    for trace in (conversation.head(2000), synthetic.head(800)):
        fast, slow = stack_distances(trace), stack_distances(trace, force_fenwick=True)
        assert fast.chained and not slow.chained
        assert np.array_equal(fast.distance, slow.distance)
        assert np.array_equal(fast.touch_distance, slow.touch_distance)
        assert np.array_equal(fast.prefix_max, slow.prefix_max)


def test_unchained_trace_falls_back_and_matches_reference() -> None:
    # Block "b" appears at different depths: not a chained trace.
    trace = trace_from_requests([["a", "b"], ["b", "c"], ["a", "b", "c"], ["c"], ["b", "a"]])
    sd = stack_distances(trace)
    assert not sd.chained
    cold = COLD
    # By hand: distinct blocks touched since the previous reference, before the request, + 1.
    assert sd.distance.tolist() == [cold, cold, 1, cold, 3, 2, 1, 1, 2, 3]
    for cap in range(0, 5):
        expected = reference_lru(trace, cap)
        curve = lru_hit_curve(trace, [cap], sd)
        assert (int(curve.hit_blocks[0]), int(curve.hit_tokens[0])) == expected


def test_hierarchy_conserves_hits_and_matches_its_shortcut(conversation: Trace) -> None:
    trace = conversation.head(3000)
    single = replay(trace, [TierSpec("all", 2400)])
    tiers = [TierSpec("host", 400), TierSpec("lmdb", 900), TierSpec("redis", 1100)]
    multi = replay(trace, tiers)
    assert np.array_equal(multi.hit_blocks, single.hit_blocks)
    assert sum(t.hit_blocks for t in multi.tiers) == single.tiers[0].hit_blocks
    # Demotions chain: what a tier evicts is what the next one receives.
    assert [t.inserted_blocks for t in multi.tiers[1:]] == [
        t.evicted_blocks for t in multi.tiers[:-1]
    ]
    assert multi.tiers[-1].evicted_blocks == single.tiers[0].evicted_blocks
    assert [t.resident_blocks for t in multi.tiers] == [400, 900, 1100]
    shortcut = lru_hierarchy(trace, stack_distances(trace), tiers)
    assert shortcut.tiers == multi.tiers
    assert np.array_equal(shortcut.tier_hit_blocks, multi.tier_hit_blocks)


def test_lfu_keeps_the_frequent_block_where_lru_loses_it() -> None:
    trace = trace_from_requests([["A"], ["A"], ["B"], ["C"], ["A"], ["B"]])
    assert replay(trace, [TierSpec("t", 2, "lfu")]).hit_blocks.tolist() == [0, 1, 0, 0, 1, 0]
    assert replay(trace, [TierSpec("t", 2, "lru")]).hit_blocks.tolist() == [0, 1, 0, 0, 0, 0]


def test_cost_policy_keeps_the_block_that_is_expensive_to_recompute() -> None:
    # B sits at depth 1 (value 10 per byte), everything else at depth 0 (value 1).
    trace = trace_from_requests([["A", "B"], ["C"], ["D"], ["B"]])
    cost = replay(trace, [TierSpec("t", 2, "cost")], value_per_byte_by_depth=[1.0, 10.0])
    assert cost.hit_blocks.tolist() == [0, 0, 0, 1]
    assert replay(trace, [TierSpec("t", 2)]).hit_blocks.tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="value_per_byte_by_depth"):
        replay(trace, [TierSpec("t", 2, "cost")])


def test_hits_count_only_leading_blocks_and_promote_from_lower_tiers() -> None:
    trace = trace_from_requests([["a", "b", "c"], ["x"], ["a", "q", "c"], ["a", "b"]])
    res = replay(trace, [TierSpec("top", 1), TierSpec("low", 10)])
    # Request 2 finds a (in low) and stops at q although c is cached; its touches promote a,
    # then q, then c through the one-block top tier, so request 3 finds a and b in low.
    assert res.hit_blocks.tolist() == [0, 0, 1, 2]
    assert res.tier_hit_blocks.tolist() == [[0, 0], [0, 0], [0, 1], [0, 2]]
    # Top-tier inserts: a b c, x, a q c, a b; every one but the last resident is demoted.
    assert [t.inserted_blocks for t in res.tiers] == [9, 8]
