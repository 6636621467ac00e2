"""The store's write policies (``cachestore.store.write_through``) on real tiers: a host tier over LMDB
(files in tmp_path) and over a real redis-server.

- ``write_through``: every saved block reaches the lower tier without an eviction, counted;
- ``write_through_selective``: only at the N-th hit;
- ``write_back``: only on eviction, or at ``shutdown_writes``' flush of host-only blocks;
- a block a lower tier holds is not rewritten (write-through, demotion and flush alike);
- a full queue drops the copy (counted, put_many never waits), also with Redis frozen (SIGSTOP);
- ``shutdown_writes`` stays bounded when the tier below hangs.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from cachestore.codec import decode_block
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from cachestore.store.types import WritePolicy, write_policies
from tests.cachestore.store_helpers import KEYS, PREFIX, SIZE, block, counters
from tiers.config import (
    WRITE_BACK,
    WRITE_THROUGH,
    WRITE_THROUGH_SELECTIVE,
    ConfigError,
    parse_tier_config,
)
from tiers.host import HostTier
from tiers.lmdb import LmdbTier


def _store(tmp_path: Path, policy: WritePolicy, host_blocks: int = 16) -> HierarchicalStore:
    tiers = [HostTier(host_blocks * SIZE, SIZE), LmdbTier(tmp_path / "db", 64 * SIZE)]
    return HierarchicalStore(
        tiers, StoreConfig(namespace=PREFIX, write_policies=(WritePolicy(), policy))
    )


def _lmdb_keys(store: HierarchicalStore) -> list[str]:
    return sorted(store.tiers[1].lru_keys())  # type: ignore[attr-defined]


def test_write_through_copies_every_saved_block_without_an_eviction(tmp_path: Path) -> None:
    store = _store(tmp_path, WritePolicy(WRITE_THROUGH))
    try:
        assert store.put_many([(k, block(i)) for i, k in enumerate(KEYS[:5])]) == 5
        assert store.wait_writes(10.0)
        assert _lmdb_keys(store) == sorted(KEYS[:5])
        assert store.tiers[0].lookup(KEYS[:5]) == 5  # still in host: nothing was evicted
        assert counters(store, "written_through") == [0, 5]
        assert counters(store, "evictions") == [0, 0]
        assert counters(store, "write_queue_depth") == [0, 0]
        # What LMDB holds is the whole encoded block: it decodes, checksum and all.
        values = store.tiers[1].get_many(KEYS[:5])
        assert [decode_block(v, PREFIX).payload for v in values] == [
            decode_block(block(i), PREFIX).payload for i in range(5)
        ]
        # A block LMDB already holds is not written again.
        store.tiers[0].delete_many(KEYS[:2])
        store.put_many([(k, block(i)) for i, k in enumerate(KEYS[:2])])
        assert store.wait_writes(10.0)
        assert counters(store, "written_through") == [0, 5]
        assert counters(store, "write_present") == [0, 2]
    finally:
        store.close()


def test_selective_write_through_waits_for_the_nth_hit(tmp_path: Path) -> None:
    store = _store(tmp_path, WritePolicy(WRITE_THROUGH_SELECTIVE, hits=2))
    try:
        store.put_many([(k, block(i)) for i, k in enumerate(KEYS[:3])])
        store.get_many(KEYS[:2])  # first hit of blocks 0 and 1
        assert store.wait_writes(10.0) and _lmdb_keys(store) == []
        store.get_many(KEYS[:1])  # block 0's second hit: copied
        assert store.wait_writes(10.0) and _lmdb_keys(store) == [KEYS[0]]
        store.get_many(KEYS[:1])  # a third hit does not queue it again
        assert store.wait_writes(10.0)
        assert counters(store, "written_through") == [0, 1]
        assert counters(store, "write_present") == [0, 0]
    finally:
        store.close()


def test_write_back_moves_blocks_on_eviction_and_at_shutdown_only(tmp_path: Path) -> None:
    store = _store(tmp_path, WritePolicy(WRITE_BACK), host_blocks=4)
    try:
        store.put_many([(k, block(i)) for i, k in enumerate(KEYS[:6])])
        store.flush()
        assert _lmdb_keys(store) == sorted(KEYS[:2])  # the two the host tier evicted
        assert counters(store, "written_back") == [0, 2]
        report = store.shutdown_writes(5.0)
        assert (report.flush_tier, report.flushed, report.flush_present, report.flush_left) == (
            "lmdb",
            4,
            0,
            0,
        )
        assert (report.drained, report.dropped) == (0, 0)
        assert _lmdb_keys(store) == sorted(KEYS[:6])
        assert counters(store, "written_back") == [0, 6]
    finally:
        store.close()


def test_demotion_of_a_block_written_through_is_not_a_rewrite(tmp_path: Path) -> None:
    store = _store(tmp_path, WritePolicy(WRITE_THROUGH), host_blocks=2)
    try:
        for i, key in enumerate(KEYS[:4]):  # one at a time: each is written through first
            store.put_many([(key, block(i))])
            assert store.wait_writes(10.0)
        store.flush()
        assert _lmdb_keys(store) == sorted(KEYS[:4])
        assert counters(store, "evictions") == [2, 0]
        assert counters(store, "written_through") == [0, 4]
        assert counters(store, "written_back") == [0, 0]
        assert counters(store, "write_present") == [0, 2]  # the two demotions, skipped
        report = store.shutdown_writes(5.0)
        assert (report.flushed, report.flush_present) == (0, 2)
    finally:
        store.close()


def test_a_full_queue_drops_copies_and_never_stalls_a_put(redis_url: str, redis_server) -> None:
    if not redis_server.managed:
        pytest.skip("needs a redis-server this test can freeze")
    from tiers.redis import RedisTier, RedisTierConfig

    redis = RedisTier(RedisTierConfig(url=redis_url, socket_timeout_s=5.0))
    store = HierarchicalStore(
        [HostTier(32 * SIZE, SIZE), redis],
        StoreConfig(
            namespace=PREFIX,
            write_policies=(WritePolicy(), WritePolicy(WRITE_THROUGH, queue_blocks=4)),
        ),
    )
    pid = redis_server._proc.pid  # noqa: SLF001 - the test freezes its own child server
    try:
        os.kill(pid, signal.SIGSTOP)  # a stalled tier: every call to it hangs
        try:
            t0 = time.perf_counter()
            assert store.put_many([(k, block(i)) for i, k in enumerate(KEYS[:10])]) == 10
            elapsed = time.perf_counter() - t0
            # One enqueue of 10 keys: 4 fit, 6 dropped at once, whatever the lane is doing.
            assert counters(store, "write_queue_dropped") == [0, 6]
            deadline = time.monotonic() + 5
            while counters(store, "write_queue_depth")[1] and time.monotonic() < deadline:
                time.sleep(0.01)  # the lane takes the 4 and hangs on the frozen server
            assert counters(store, "write_queue_depth") == [0, 0]
            t1 = time.perf_counter()
            assert store.put_many([(k, block(i)) for i, k in enumerate(KEYS[10:16])]) == 6
            elapsed = max(elapsed, time.perf_counter() - t1)
            assert counters(store, "write_queue_dropped") == [0, 8]
            assert counters(store, "write_queue_depth") == [0, 4]
            assert not store.wait_writes(0.2)  # bounded: the lane cannot finish meanwhile
        finally:
            os.kill(pid, signal.SIGCONT)
        assert elapsed < 1.0
        assert store.wait_writes(10.0)
        expect = [True] * 4 + [False] * 6 + [True] * 4 + [False] * 2
        assert store.tiers[1].contains_many(KEYS[:16]) == expect
        assert counters(store, "written_through") == [0, 8]
        # Shutdown flushes the host-only blocks down to redis.
        report = store.shutdown_writes(5.0)
        assert (report.flush_tier, report.flushed, report.flush_present) == ("redis", 8, 8)
        assert store.tiers[1].contains_many(KEYS[:16]) == [True] * 16
    finally:
        store.close()


def test_write_policy_fields_parse_with_write_through_defaults(tmp_path: Path) -> None:
    stack = parse_tier_config(
        {
            "tiers": [
                {"kind": "host", "capacity": "1MiB"},
                {"kind": "lmdb", "path": str(tmp_path), "capacity": "1MiB"},
                {"kind": "redis", "url": "redis://h:1/0", "write_policy": "write_back"},
                {
                    "kind": "s3",
                    "bucket": "b",
                    "write_policy": "write_through_selective",
                    "write_through_hits": 3,
                    "write_queue_blocks": 8,
                },
                {"kind": "remote", "url": "tcp://h:1"},
            ]
        }
    )
    assert write_policies(stack) == (
        WritePolicy(WRITE_BACK),
        WritePolicy(WRITE_THROUGH),
        WritePolicy(WRITE_BACK),
        WritePolicy(WRITE_THROUGH_SELECTIVE, hits=3, queue_blocks=8),
        WritePolicy(WRITE_THROUGH),
    )
    with pytest.raises(
        ConfigError, match=r"tiers\[1\] \(lmdb\): field 'write_policy': expected one"
    ):
        parse_tier_config(
            {
                "tiers": [
                    {"kind": "host", "capacity": "1MiB"},
                    {"kind": "lmdb", "path": "x", "capacity": "1MiB", "write_policy": "through"},
                ]
            }
        )
    with pytest.raises(ConfigError, match="write_queue_blocks"):
        parse_tier_config(
            {"tiers": [{"kind": "remote", "url": "tcp://h:1", "write_queue_blocks": 0}]}
        )
    with pytest.raises(ConfigError, match="unknown field"):
        parse_tier_config(
            {"tiers": [{"kind": "host", "capacity": "1MiB", "write_policy": "write_back"}]}
        )


def test_shutdown_is_bounded_when_the_tier_below_hangs(redis_url: str, redis_server) -> None:
    if not redis_server.managed:
        pytest.skip("needs a redis-server this test can freeze")
    from tiers.redis import RedisTier, RedisTierConfig

    redis = RedisTier(RedisTierConfig(url=redis_url, socket_timeout_s=1.0, retries=0))
    store = HierarchicalStore(
        [HostTier(32 * SIZE, SIZE), redis],
        StoreConfig(namespace=PREFIX, write_policies=(WritePolicy(), WritePolicy(WRITE_THROUGH))),
    )
    pid = redis_server._proc.pid  # noqa: SLF001 - the test freezes its own child server
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            store.put_many([(k, block(i)) for i, k in enumerate(KEYS[:10])])
            deadline = time.monotonic() + 5
            while counters(store, "write_queue_depth")[1] and time.monotonic() < deadline:
                time.sleep(0.01)  # the lane takes the 10 and hangs on the frozen server
            store.put_many([(k, block(i)) for i, k in enumerate(KEYS[10:15])])
            t0 = time.monotonic()
            report = store.shutdown_writes(0.3)
            elapsed = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        # The 5 still queued after the drain's 0.3 s are dropped; the lane's batch fails on the
        # socket timeout (1 s), so redis backs off and nothing is flushed to it.
        assert (report.drained, report.dropped) == (0, 5)
        assert (report.flush_tier, report.flushed) == (None, 0)
        assert counters(store, "write_queue_dropped") == [0, 5]
        assert counters(store, "written_through") == [0, 0]
        assert elapsed < 4.0
    finally:
        store.close()


def test_host_evicts_what_lmdb_holds_without_copying_it_out(tmp_path: Path) -> None:
    """Write-through put every block in LMDB already: evicting it from the host tier copies
    nothing (no bytes on the evicting thread), demotes nothing, loses nothing. A block LMDB
    lacks (write-back) is still copied out and demoted."""
    for policy, held in ((WritePolicy(WRITE_THROUGH), True), (WritePolicy(WRITE_BACK), False)):
        store = _store(tmp_path / policy.policy, policy, host_blocks=2)
        host = store.tiers[0]
        try:
            store.put_many([(k, block(i)) for i, k in enumerate(KEYS[:2])])
            assert store.wait_writes(10.0)
            res = store.reserve_host(KEYS[2], SIZE)  # a save's slot: evicts KEYS[0]
            assert res is not None and [e.key for e in res.evicted] == [KEYS[0]]
            assert res.evicted[0].held_below is held
            assert (res.evicted[0].value is None) is held
            store.abort_host(KEYS[2])
            store.flush(10.0)  # the demotion, where there is one
            assert host.lookup(KEYS[:1]) == 0
            assert store.tiers[1].lookup(KEYS[:1]) == 1  # LMDB serves it either way
            value = store.tiers[1].get_many(KEYS[:1])[0]
            assert decode_block(value, PREFIX).payload == decode_block(block(0), PREFIX).payload
            present, written_back = (
                counters(store, "write_present"),
                counters(store, "written_back"),
            )
            assert (present[1], written_back[1]) == ((1, 0) if held else (0, 1))
            assert counters(store, "demotions_dropped") == [0, 0]
        finally:
            store.close()
