"""Hierarchical store: exact demotion counts, promotion, lookup, corruption and failing tiers."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from cachestore.codec import BlockMeta, encode_block
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from tests.cachestore.store_helpers import (
    KEYS,
    PREFIX,
    SIZE,
    DownTier,
    FakeClock,
    PinLogHost,
    PinLogLmdb,
    block,
    counters,
    make_store,
    payload,
)
from tiers import build_tiers
from tiers.base import TierUsage
from tiers.config import parse_tier_config
from tiers.host import HostTier
from tiers.lmdb import LmdbTier


def test_fill_beyond_capacity_demotes_host_to_lmdb_then_drops(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    host, lmdb = store.tiers
    for i in range(12):
        assert store.put_many([(KEYS[i], block(i))]) == 1
    store.flush()
    assert host.lru_keys() == KEYS[8:12]
    assert lmdb.lru_keys() == KEYS[2:8]
    assert counters(store, "evictions") == [8, 2]
    assert counters(store, "dropped_at_bottom") == [0, 2]
    assert counters(store, "bytes_written") == [12 * SIZE, 8 * SIZE]
    res = store.lookup(KEYS[2:12])
    assert [t.num_leading for t in res.per_tier] == [0, 6]
    assert res.served_by == (1,) * 6 + (0,) * 4 and res.runs() == [(1, 0, 6), (0, 6, 4)]
    assert store.lookup(KEYS[:12]).num_blocks == 0  # KEYS[0] is gone everywhere
    store.close()


def test_get_decodes_promotes_and_counts(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    host, lmdb = store.tiers
    for i in range(8):
        store.put_many([(KEYS[i], block(i))])
    store.flush()
    assert lmdb.lru_keys() == KEYS[0:4] and host.lru_keys() == KEYS[4:8]
    got = store.get_many([KEYS[5], KEYS[1], KEYS[20]])
    assert [None if g is None else bytes(g) for g in got] == [payload(5), payload(1), None]
    store.flush()
    # KEYS[1] was promoted to host, which evicted its LRU entry KEYS[4] down to LMDB.
    assert host.lru_keys() == [KEYS[6], KEYS[7], KEYS[5], KEYS[1]]
    assert lmdb.lru_keys() == [KEYS[0], KEYS[2], KEYS[3], KEYS[1], KEYS[4]]
    assert counters(store, "hits") == [1, 1] and counters(store, "misses") == [2, 1]
    assert counters(store, "promotions") == [1, 0]
    assert counters(store, "bytes_read") == [SIZE, SIZE]
    assert store.stats()["tiers"][1]["read_bandwidth_bps"] > 0
    store.close()


def test_corrupt_or_foreign_value_in_lower_tier_is_a_miss(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    lmdb = store.tiers[1]
    bad = bytearray(block(1))
    bad[-20] ^= 0x01
    other = encode_block(payload(2), BlockMeta("uint8", (32,), "block_major_v1", "other-ns"))
    lmdb.put_many([(KEYS[1], bytes(bad)), (KEYS[2], other), (KEYS[3], block(3))])
    got = store.get_many(KEYS[1:4])
    assert got[0] is None and got[1] is None and bytes(got[2]) == payload(3)
    assert counters(store, "corrupt") == [0, 2]
    assert counters(store, "hits") == [0, 1] and counters(store, "misses") == [3, 2]
    assert lmdb.lookup([KEYS[1]]) == 0 and lmdb.lookup([KEYS[2]]) == 0  # bad values deleted
    store.close()


def test_pins_dedup_and_full_demotion_queue(tmp_path: Path) -> None:
    store = make_store(tmp_path, queue_batches=1)
    host, lmdb = store.tiers
    assert store.prepare_store(KEYS[:3]) == KEYS[:3]
    assert store.prepare_store(KEYS[1:5]) == KEYS[3:5]  # 1, 2 already being stored
    store.put_many([(KEYS[i], block(i)) for i in range(4)])
    store.complete_store(KEYS[:5], success=True)
    assert store.prepare_store(KEYS[:6]) == [KEYS[4], KEYS[5]]  # 0..3 now at the top
    store.complete_store(KEYS[4:6], success=False)
    spec = store.prepare_load([KEYS[0], KEYS[1], KEYS[9]])
    assert spec.num_pinned == 2
    assert store.stats()["load_pins"] == 2
    # Hold the LMDB writer so that the store's demotion worker blocks on its first batch.
    with lmdb._lock:
        store.put_many([(KEYS[4], block(4))])
        deadline = time.monotonic() + 10
        while store.stats()["tiers"][1]["queue_batches"] and time.monotonic() < deadline:
            time.sleep(0.001)  # until the worker has taken the batch and blocks in LMDB
        for i in range(5, 8):
            store.put_many([(KEYS[i], block(i))])
        # Evictions, oldest unpinned first: 2 (taken by the worker), 3 (queued), 4, 5 (dropped).
        assert [k in host.lru_keys() for k in KEYS[:2]] == [True, True]
        assert counters(store, "demotions_dropped") == [2, 0]
    store.flush()
    assert lmdb.lru_keys() == [KEYS[2], KEYS[3]]
    store.complete_load(spec)
    assert store.stats()["load_pins"] == 0
    store.put_many([(KEYS[8], block(8))])
    store.flush()
    assert KEYS[0] not in host.lru_keys() and lmdb.lru_keys()[-1] == KEYS[0]
    store.close()


def test_prepare_load_pins_with_one_call_per_tier(tmp_path: Path) -> None:
    calls: list[tuple[str, str, list[str]]] = []
    host, lmdb = PinLogHost(4 * SIZE, SIZE), PinLogLmdb(tmp_path / "db", 6 * SIZE)
    host.calls = lmdb.calls = calls
    store = HierarchicalStore([host, lmdb], StoreConfig(namespace=PREFIX))
    for i in range(6):
        store.put_many([(KEYS[i], block(i))])
    store.flush()
    assert host.lru_keys() == KEYS[2:6] and lmdb.lru_keys() == KEYS[:2]
    batch = [KEYS[0], KEYS[2], KEYS[1], KEYS[20], KEYS[3], KEYS[3]]
    spec = store.prepare_load(batch)
    assert spec.num_pinned == 3  # KEYS[20] is nowhere; 3 is pinned past it, twice
    assert calls == [("host", "pin_each", batch), ("lmdb", "pin_each", batch)]
    assert store.stats()["load_pins"] == 5
    for i in range(6, 9):
        store.put_many([(KEYS[i], block(i))])
    assert host.lru_keys() == [KEYS[2], KEYS[3], KEYS[7], KEYS[8]]  # pinned 2, 3 stayed
    calls.clear()
    store.complete_load(spec)
    assert calls == [
        ("host", "unpin", [KEYS[2], KEYS[3], KEYS[3]]),
        ("lmdb", "unpin", [KEYS[0], KEYS[1]]),
    ]
    assert store.stats()["load_pins"] == 0 and store.prepare_load([]).num_pinned == 0
    store.put_many([(KEYS[9], block(9))])
    assert host.lru_keys() == [KEYS[3], KEYS[7], KEYS[8], KEYS[9]]  # 2 unpinned: evicted
    store.close()


def test_prometheus_export(tmp_path: Path) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    store = HierarchicalStore([HostTier(4 * SIZE, SIZE)], StoreConfig(), registry=registry)
    store.put_many([(KEYS[0], block(0))])
    store.get_many([KEYS[0], KEYS[1]])
    assert registry.get_sample_value("kvtier_store_hits_total", {"tier": "host"}) == 1.0
    assert registry.get_sample_value("kvtier_store_misses_total", {"tier": "host"}) == 1.0
    assert registry.get_sample_value("kvtier_store_bytes_written_total", {"tier": "host"}) == float(
        SIZE
    )
    store.close()
    assert registry.get_sample_value("kvtier_store_hits_total", {"tier": "host"}) is None


def _four_tiers(
    tmp_path: Path, redis_config: dict[str, Any], s3_config: dict[str, Any]
) -> list[Any]:
    """host 2 blocks -> LMDB 3 blocks -> Redis 2 blocks (tier-side LRU) -> S3 (unbounded)."""
    cfg = parse_tier_config(
        {
            "tiers": [
                {"kind": "host", "capacity": f"{2 * SIZE}B", "slot_bytes": f"{SIZE}B"},
                {"kind": "lmdb", "path": str(tmp_path / "db"), "capacity": f"{3 * SIZE}B"},
                {**redis_config, "capacity": f"{2 * SIZE}B"},
                dict(s3_config),
            ]
        }
    )
    return build_tiers(cfg)


def test_four_tiers_demote_in_order_and_promote_from_s3(
    tmp_path: Path, redis_config: dict[str, Any], s3_config: dict[str, Any]
) -> None:
    store = HierarchicalStore(
        _four_tiers(tmp_path, redis_config, s3_config), StoreConfig(namespace=PREFIX)
    )
    host, lmdb, redis, s3 = store.tiers
    for i in range(10):
        assert store.put_many([(KEYS[i], block(i))]) == 1
    store.flush()
    # Pressure pushed every block exactly one tier further per eviction: 8 left host, 5 of
    # them left LMDB, 3 of those left Redis for S3, which holds them byte for byte.
    assert host.lru_keys() == KEYS[8:10] and lmdb.lru_keys() == KEYS[5:8]
    assert redis.usage() == TierUsage(2 * SIZE, 2 * SIZE, 2)
    assert redis.lookup(KEYS[3:5]) == 2 and redis.lookup(KEYS[:3]) == 0
    assert s3.usage().num_entries == 3
    assert [bytes(v) for v in s3.get_many(KEYS[:3])] == [block(i) for i in range(3)]
    assert counters(store, "evictions") == [8, 5, 3, 0]
    assert counters(store, "bytes_written") == [10 * SIZE, 8 * SIZE, 5 * SIZE, 3 * SIZE]
    assert counters(store, "demotions_dropped") == [0, 0, 0, 0]
    assert counters(store, "dropped_at_bottom") == [0, 0, 0, 0]
    res = store.lookup(KEYS[:10])
    assert res.served_by == (3, 3, 3, 2, 2, 1, 1, 1, 0, 0)
    assert [t.num_leading for t in res.per_tier] == [0, 0, 0, 3]
    assert res.runs() == [(3, 0, 3), (2, 3, 2), (1, 5, 3), (0, 8, 2)]
    # KEYS[1] lives only in S3: a read decodes it and promotes it to host, and the room made
    # for it cascades: host evicts 8 -> LMDB evicts 5 -> Redis evicts 3 -> S3.
    (got,) = store.get_many([KEYS[1]])
    assert got is not None and bytes(got) == payload(1)
    store.flush()
    assert host.lru_keys() == [KEYS[9], KEYS[1]]
    assert lmdb.lru_keys() == [KEYS[6], KEYS[7], KEYS[8]]
    assert redis.lookup(KEYS[4:6]) == 2 and redis.usage().num_entries == 2
    assert s3.lookup(KEYS[:4]) == 4 and s3.usage().num_entries == 4
    assert counters(store, "hits") == [0, 0, 0, 1] and counters(store, "misses") == [1, 1, 1, 0]
    assert counters(store, "promotions") == [1, 0, 0, 0]
    assert counters(store, "evictions") == [9, 6, 4, 0]
    assert store.lookup(KEYS[:10]).served_by == (3, 0, 3, 3, 2, 2, 1, 1, 1, 0)
    store.close()


def test_failing_tier_degrades_to_misses_with_backoff(
    tmp_path: Path, redis_server: Any, redis_config: dict[str, Any]
) -> None:
    clock = FakeClock()
    cfg = parse_tier_config(
        {
            "tiers": [
                {"kind": "host", "capacity": f"{2 * SIZE}B", "slot_bytes": f"{SIZE}B"},
                {**redis_config, "socket_timeout_s": 0.5, "connect_timeout_s": 0.5, "retries": 0},
            ]
        }
    )
    store = HierarchicalStore(
        build_tiers(cfg), StoreConfig(namespace=PREFIX, backoff_initial_s=10.0), clock=clock
    )
    store.tiers[1].put_many([(KEYS[0], block(0))])
    redis_server.stop()
    try:
        assert store.get_many([KEYS[0]]) == [None]
        assert counters(store, "errors") == [0, 1]
        assert store.lookup([KEYS[0]]).num_blocks == 0  # backing off: skipped, no error
        assert counters(store, "errors") == [0, 1] and counters(store, "skipped")[1] >= 1
        for i in range(1, 4):  # host evictions demoted into the dead tier: passed on, dropped
            store.put_many([(KEYS[i], block(i))])
        store.flush()
        assert counters(store, "evictions") == [1, 0]
        assert counters(store, "dropped_at_bottom") == [0, 1]  # skipped tier passes it down
        assert store.get_many([KEYS[3]])[0] is not None
        clock.now += 10.0  # backoff over: the next call probes and fails again (20 s now)
        assert store.get_many([KEYS[0]]) == [None] and counters(store, "errors") == [0, 2]
    finally:
        redis_server.start()
    clock.now += 20.0
    store.tiers[1].put_many([(KEYS[9], block(9))])  # the restarted server starts empty
    (got,) = store.get_many([KEYS[9]])
    assert got is not None and bytes(got) == payload(9)
    assert store.stats()["tiers"][1]["consecutive_failures"] == 0
    store.close()


def test_write_through_commits_to_the_durable_tier_before_returning(tmp_path: Path) -> None:
    store = make_store(tmp_path, write_through_to=1)
    host, lmdb = store.tiers
    assert store.put_many([(KEYS[i], block(i)) for i in range(3)]) == 3
    # No flush: the put itself wrote both tiers.
    assert host.lookup(KEYS[:3]) == 3 and lmdb.lookup(KEYS[:3]) == 3
    assert counters(store, "bytes_written") == [3 * SIZE, 3 * SIZE]
    store.close()
    reopened = LmdbTier(tmp_path / "db", 6 * SIZE)  # what a restarted process finds
    assert [bytes(v) for v in reopened.get_many(KEYS[:3])] == [block(i) for i in range(3)]
    reopened.close()
    # A durable tier that fails: 0 written (not durable), though the top tier took it.
    broken = HierarchicalStore(
        [HostTier(4 * SIZE, SIZE), DownTier()], StoreConfig(namespace=PREFIX, write_through_to=1)
    )
    assert broken.put_many([(KEYS[5], block(5))]) == 0
    assert counters(broken, "errors") == [0, 1] and broken.tiers[0].lookup([KEYS[5]]) == 1
    broken.close()
    with pytest.raises(ValueError, match="only 2 tier"):
        make_store(tmp_path / "x", write_through_to=2)
    with pytest.raises(ValueError, match="write_through_to"):
        StoreConfig(write_through_to=-1)


def test_encoded_reads_delete_usage_and_drops(tmp_path: Path) -> None:
    dropped: list[str] = []
    tiers = [HostTier(2 * SIZE, SIZE), LmdbTier(tmp_path / "db", 3 * SIZE)]
    store = HierarchicalStore(tiers, StoreConfig(namespace=PREFIX), on_drop=dropped.extend)
    host, lmdb = store.tiers
    for i in range(6):
        store.put_many([(KEYS[i], block(i))])
        store.flush()
    # Host keeps 4, 5; its evictions 0..3 went to LMDB (3 blocks), which dropped KEYS[0].
    assert host.lru_keys() == KEYS[4:6] and lmdb.lru_keys() == KEYS[1:4]
    assert dropped == [KEYS[0]]
    usage = store.tier_usage()
    assert {n: u.num_entries for n, u in usage.items()} == {"host": 2, "lmdb": 3}
    assert usage["lmdb"].used_bytes == 3 * SIZE
    assert store.delete_many([KEYS[5], KEYS[3], KEYS[9]]) == 1  # one in each tier
    assert store.lookup([KEYS[5]]).num_blocks == 0 and store.lookup([KEYS[3]]).num_blocks == 0
    bad = bytearray(block(7))
    bad[-12] ^= 0x01
    lmdb.put_many([(KEYS[7], bytes(bad))])
    got = store.get_many_encoded([KEYS[4], KEYS[2], KEYS[0], KEYS[7]])
    assert [None if g is None else bytes(g) for g in got] == [block(4), block(2), None, None]
    assert counters(store, "corrupt") == [0, 1] and lmdb.lookup([KEYS[7]]) == 0
    store.flush()
    assert host.lookup([KEYS[2]]) == 1  # promoted like a decoded read
    assert store.delete_many([]) == 0
    store.close()


def test_stage_host_places_and_pins_only_what_fits(tmp_path) -> None:
    from cachestore.codec import BlockMeta, encode_block, encoded_size
    from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
    from tiers.host import HostTier
    from tiers.lmdb import LmdbTier

    meta = BlockMeta(dtype="uint8", shape=(64,), layout="t", namespace="ns")
    size = encoded_size(meta)
    host = HostTier(3 * size, size)
    store = HierarchicalStore(
        [host, LmdbTier(str(tmp_path / "l"), 1 << 20)],
        StoreConfig(namespace="ns", promote_on_get=False),
    )
    try:
        blocks = {f"ns/{i}": encode_block(bytes([i]) * 64, meta) for i in range(5)}
        store.tiers[1].put_many(list(blocks.items()))
        keys = list(blocks)
        assert store.stage_host(keys[:2]) == 2  # read from LMDB, written, pinned
        assert host.lru_keys() == keys[:2] and all(e.pins == 1 for e in host._entries.values())
        assert host.available_slots() == 1
        assert store.stage_host(keys[2:5]) == 0  # 3 would not fit beside 2 pinned: untouched
        assert host.lru_keys() == keys[:2]
        store.unpin_host(keys[:2])
        assert store.stage_host(keys[1:4]) == 3  # 1 present (pinned again) + 2 placed
        assert sorted(host.lru_keys()) == sorted(keys[1:4])
        assert [bytes(v) for v in host.get_many(keys[1:4])] == [blocks[k] for k in keys[1:4]]
        store.unpin_host(keys[1:4])
        assert all(e.pins == 0 for e in host._entries.values())
    finally:
        store.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_stage_host_reads_straight_into_slots_in_chunks(tmp_path, threads: int) -> None:
    """A stage of many blocks: each is read from LMDB into its reserved slot (checked there),
    committed at its own size and pinned; chunks run on ``threads`` readers. A corrupt block
    stays out, its slot freed, and the stage stops before it; nothing is promoted or re-written."""
    from cachestore.codec import BlockMeta, encode_block, encoded_size
    from cachestore.store import host as host_path
    from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
    from tiers.host import HostTier
    from tiers.lmdb import LmdbTier

    meta = BlockMeta(dtype="uint8", shape=(96,), layout="t", namespace="ns")
    small = BlockMeta(dtype="uint8", shape=(40,), layout="t", namespace="ns")
    size = encoded_size(meta)
    n = 3 * host_path.STAGE_CHUNK_BLOCKS + 5
    host = HostTier((n + 2) * size, size)
    store = HierarchicalStore(
        [host, LmdbTier(str(tmp_path / "l"), 64 << 20)], StoreConfig(namespace="ns")
    )
    store._host._stage_threads = threads
    try:
        keys = [f"ns/{i}" for i in range(n)]
        blocks = {
            k: encode_block(bytes([i % 251]) * (96 if i % 7 else 40), meta if i % 7 else small)
            for i, k in enumerate(keys)
        }
        store.tiers[1].put_many(list(blocks.items()))
        assert store.stage_host(keys) == n
        assert [bytes(v) for v in host.get_many(keys)] == [blocks[k] for k in keys]
        assert all(e.pins == 1 for e in host._entries.values())
        host.check_integrity()
        store.unpin_host(keys)
        store.flush()
        assert counters(store, "written_back") == [0, 0] and counters(store, "promotions") == [0, 0]

        bad = bytearray(blocks[keys[-3]])
        bad[-5] ^= 0x01
        store.tiers[1].put_many([(keys[-3], bytes(bad))])
        host.delete_many(keys)
        assert store.stage_host(keys) == n - 3
        assert host.lookup(keys) == n - 3
        assert sorted(host.lru_keys()) == sorted(keys[:-3] + keys[-2:])
        assert host.num_pins() == n - 3  # the two good blocks after it: placed, then unpinned
        host.check_integrity()
        store.unpin_host(keys[: n - 3])
    finally:
        store.close()


def test_a_host_tier_lacking_a_history_is_asked_once_not_per_block(tmp_path: Path) -> None:
    """A reload from LMDB under a small host tier: the host tier lacks the history but for a
    few blocks. Asked once for its leading run and once for the rest (``contains_many``), not
    once per block LMDB serves: each of those calls takes the tier's lock and cost ~7 us, 277
    of them for one 6.5K-token reload. Each block is still served by the top tier holding it."""
    store = make_store(tmp_path, host_blocks=4, lmdb_blocks=16)
    host, lmdb = store.tiers
    lmdb.put_many([(k, block(i)) for i, k in enumerate(KEYS[:12])])
    host.put_many([(KEYS[i], block(i)) for i in (4, 9)])
    calls: list[str] = []
    for name in ("lookup", "contains_many"):
        real = getattr(host, name)
        setattr(host, name, lambda keys, _r=real, _n=name: calls.append(_n) or _r(keys))
    res = store.lookup(KEYS[:12])
    assert res.served_by == (1, 1, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1)
    assert calls == ["lookup", "contains_many"]
    assert [t.num_leading for t in res.per_tier] == [0, 12]
    store.close()


def test_the_host_tier_evicts_a_block_lmdb_holds_before_one_it_would_copy_out(
    tmp_path: Path,
) -> None:
    """Clean-first LRU: among its least recent entries the host tier evicts one LMDB already
    holds (nothing to copy or demote) before an older one LMDB lacks (2 MiB copied out on the
    saving thread and queued, in no tier a lookup sees until LMDB writes it). With none
    within ``CLEAN_FIRST``, the least recent goes, copied out and demoted."""
    store = make_store(tmp_path, host_blocks=4, lmdb_blocks=16)
    host, lmdb = store.tiers
    lmdb.put_many([(KEYS[2], block(2))])
    host.put_many([(KEYS[i], block(i)) for i in range(4)])  # 0, 1, 3 only here; 2 in LMDB too
    store.put_many([(KEYS[4], block(4))])
    store.flush()
    assert host.lru_keys() == [KEYS[0], KEYS[1], KEYS[3], KEYS[4]]
    assert counters(store, "demoted") == [0, 0] and lmdb.lru_keys() == [KEYS[2]]
    store.put_many([(KEYS[5], block(5))])  # nothing clean left: the least recent, copied out
    store.flush()
    assert host.lru_keys() == [KEYS[1], KEYS[3], KEYS[4], KEYS[5]]
    assert counters(store, "demoted") == [1, 0] and KEYS[0] in lmdb.lru_keys()
    assert host.num_copied_out == 1
    store.close()
