"""Placement that follows the physics: a tier from which even the longest prefix loads slower
than it recomputes is skipped by demotion (counted), the tier below gets the blocks, blocks
already there stay readable; a tier that pays, the top tier and a durable write-through tier
are never skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachestore.cost.model import PrefillCost, TierCost
from cachestore.cost.placement import tier_verdicts, unprofitable_tiers
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from cachestore.store.types import WritePolicy
from tests.cachestore.store_helpers import KEYS, PREFIX, SIZE, block, counters
from tiers.config import WRITE_THROUGH
from tiers.host import HostTier
from tiers.lmdb import LmdbTier

MB = 1 << 20
# An 8B-like model: 128 KiB of KV per token, 16-token blocks of 2 MiB; ~26 us/token prefill.
PREFILL = PrefillCost(fixed_s=0.005, per_token_s=26e-6, attention_s=1e-10)
COSTS = {
    "host": TierCost("host", 1e-4, 55e9),
    "lmdb": TierCost("lmdb", 2e-3, 0.38e9),
    "redis": TierCost("redis", 1e-3, 10e9),
}


def test_a_tier_slower_than_recompute_at_its_best_case_is_unprofitable() -> None:
    verdicts = {
        v.name: v
        for v in tier_verdicts(
            COSTS, PREFILL, block_bytes=2 * MB, block_tokens=16, max_prefix_tokens=16_400
        )
    }
    assert set(verdicts) == {"lmdb", "redis"}  # host is always worth it
    lmdb, redis = verdicts["lmdb"], verdicts["redis"]
    assert lmdb.prefix_tokens == redis.prefix_tokens == 16_400 // 16 * 16
    # 1025 blocks of 2 MiB at 0.38 GB/s: ~5.7 s, against ~0.45 s of prefill.
    assert lmdb.load_s == pytest.approx(2e-3 + 1e-4 + 1025 * 2 * MB / 0.38e9)
    assert not lmdb.pays and redis.pays
    names = [
        v.name
        for v in unprofitable_tiers(
            COSTS, PREFILL, block_bytes=2 * MB, block_tokens=16, max_prefix_tokens=16_400
        )
    ]
    assert names == ["lmdb"]
    with pytest.raises(ValueError, match="block_tokens"):
        tier_verdicts(COSTS, PREFILL, block_bytes=2 * MB, block_tokens=16, max_prefix_tokens=8)


def _store(tmp_path: Path, *policies: WritePolicy) -> HierarchicalStore:
    tiers = [
        HostTier(2 * SIZE, SIZE),
        LmdbTier(tmp_path / "a", 64 * SIZE),
        LmdbTier(tmp_path / "b", 64 * SIZE),
    ]
    tiers[1].name, tiers[2].name = "lmdb", "disk"
    return HierarchicalStore(
        tiers,
        StoreConfig(
            namespace=PREFIX,
            write_policies=(WritePolicy(), *(policies or (WritePolicy(), WritePolicy()))),
        ),
    )


def test_demotion_passes_a_skipped_tier_and_counts_it(tmp_path: Path) -> None:
    store = _store(tmp_path)
    try:
        store.skip_tiers(["lmdb", "host"])  # the top tier is never skipped
        for i, key in enumerate(KEYS[:6]):
            store.put_many([(key, block(i))])
        store.flush()
        lmdb, disk = store.tiers[1], store.tiers[2]
        evicted = counters(store, "evictions")[0]
        assert evicted == 4  # a host tier of two blocks
        assert counters(store, "placement_skipped") == [0, evicted, 0]
        assert [lmdb.lookup([k]) for k in KEYS[:6]] == [0] * 6
        assert [disk.lookup([k]) for k in KEYS[:6]] == [1] * 4 + [0] * 2  # landed below
        assert store.tiers[0].lookup(KEYS[4:6]) == 2
        # Undo: demotion into LMDB again.
        store.skip_tiers([])
        for i, key in enumerate(KEYS[6:9], start=6):
            store.put_many([(key, block(i))])
        store.flush()
        assert counters(store, "placement_skipped")[1] == evicted
        assert counters(store, "written_back")[1] > 0
    finally:
        store.close()


def test_a_write_through_lane_to_a_skipped_tier_copies_nothing(tmp_path: Path) -> None:
    store = _store(tmp_path, WritePolicy(WRITE_THROUGH), WritePolicy(WRITE_THROUGH))
    try:
        store.skip_tiers(["lmdb"])
        for i, key in enumerate(KEYS[:5]):
            store.put_many([(key, block(i))])
        assert store.wait_writes(10.0)
        store.flush()
        skipped = counters(store, "placement_skipped")
        assert skipped[0] == skipped[2] == 0 and skipped[1] >= 5  # lane (5) + demotions
        assert counters(store, "written_through")[:2] == [0, 0]
        assert [store.tiers[1].lookup([k]) for k in KEYS[:5]] == [0] * 5
        assert [store.tiers[2].lookup([k]) for k in KEYS[:5]] == [1] * 5
    finally:
        store.close()


def test_an_acknowledged_puts_durable_tier_is_never_skipped(tmp_path: Path) -> None:
    tiers = [HostTier(2 * SIZE, SIZE), LmdbTier(tmp_path / "a", 64 * SIZE)]
    store = HierarchicalStore(tiers, StoreConfig(namespace=PREFIX, write_through_to=1))
    try:
        store.skip_tiers([tiers[1].name])
        assert store.put_many([(KEYS[0], block(0))]) == 1
        assert tiers[1].lookup(KEYS[:1]) == 1
        assert counters(store, "placement_skipped") == [0, 0]
    finally:
        store.close()
