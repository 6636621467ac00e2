"""Demoted blocks queued for the tier below are read as that tier's until it has written them.

With a tier below that writes slower than the tier above evicts (LMDB putting fresh pages,
Redis or S3 over a network), a block sat in the demotion queue, in no tier: lookups and reads
missed it and the engine recomputed a prefix whose bytes were in this process's memory."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.cachestore.store_helpers import KEYS, SIZE, block, counters, make_store, payload


def _until_taken(store, tier: int = 1) -> None:
    """Wait until the demotion worker of ``tier`` took the queued batch (it then blocks)."""
    deadline = time.monotonic() + 10
    while store.stats()["tiers"][tier]["queue_batches"] and time.monotonic() < deadline:
        time.sleep(0.001)


def test_blocks_queued_for_lmdb_are_looked_up_and_read_before_it_writes(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, lmdb_blocks=16, promote_on_get=False)
    host, lmdb = store.tiers
    with lmdb._lock:  # LMDB's writer waits: every demotion stays on its way down
        for i in range(10):
            store.put_many([(KEYS[i], block(i))])
            if i == 4:
                _until_taken(store)  # the first batch is in the worker's hands, not queued
        assert host.lru_keys() == KEYS[6:10]
        assert not any(k in lmdb._index for k in KEYS[:10])  # nothing written yet
        res = store.lookup(KEYS[:10])
        assert res.served_by == (1,) * 6 + (0,) * 4
        assert [None if v is None else bytes(v) for v in store.get_many(KEYS[:6])] == [
            payload(i) for i in range(6)
        ]
        bufs = [bytearray(SIZE + 7) for _ in range(6)]
        assert store.get_many_into(KEYS[:6], bufs, promote=False) == [SIZE] * 6
        assert [bytes(b[:SIZE]) for b in bufs] == [block(i) for i in range(6)]
        small = [bytearray(SIZE - 1)]  # too small: its length, nothing checked, as a tier does
        assert store.get_many_into(KEYS[:1], small, promote=False) == [SIZE]
        assert counters(store, "inflight_hits") == [0, 12]
        assert counters(store, "demotions_dropped") == [0, 0]
    store.flush()  # written now: the same answers, from LMDB itself
    assert lmdb.lru_keys() == KEYS[:6]
    assert store.lookup(KEYS[:10]).served_by == (1,) * 6 + (0,) * 4
    assert [bytes(v) for v in store.get_many(KEYS[:6])] == [payload(i) for i in range(6)]
    assert counters(store, "inflight_hits") == [0, 12]
    assert store._inflight.count(1) == 0
    store.close()


def test_a_demotion_the_full_queue_dropped_is_not_read(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, lmdb_blocks=16, queue_batches=1)
    host, lmdb = store.tiers
    with lmdb._lock:
        for i in range(5):
            store.put_many([(KEYS[i], block(i))])
        _until_taken(store)  # KEYS[0] is in the worker's hands
        for i in range(5, 8):
            store.put_many([(KEYS[i], block(i))])
        # KEYS[1] queued, KEYS[2] and KEYS[3] dropped: the queue holds one batch
        assert counters(store, "demotions_dropped") == [2, 0]
        assert store.lookup(KEYS[:2]).served_by == (1, 1)
        assert store.lookup(KEYS[2:4]).served_by == ()
        assert store.get_many(KEYS[2:4]) == [None, None]
    store.flush()
    assert lmdb.lru_keys() == KEYS[:2]
    assert store._inflight.count(1) == 0
    store.close()


def test_a_deleted_block_is_not_read_from_the_queue(tmp_path: Path) -> None:
    """Deleted from the store while its demotion waits: no longer read from the queue (the
    queued write itself may still land, as before)."""
    store = make_store(tmp_path, host_blocks=4, lmdb_blocks=16, promote_on_get=False)
    _, lmdb = store.tiers
    gate = threading.Event()
    put_many = lmdb.put_many

    def held_put_many(items):  # the demotion worker waits here; LMDB itself stays free
        gate.wait(10)
        return put_many(items)

    lmdb.put_many = held_put_many
    try:
        for i in range(6):
            store.put_many([(KEYS[i], block(i))])
        assert store.lookup(KEYS[:2]).served_by == (1, 1)
        store.delete_many(KEYS[1:2])
        assert store.lookup(KEYS[:2]).served_by == (1,)
        assert store.get_many(KEYS[1:2]) == [None]
    finally:
        gate.set()
    store.flush()
    store.close()
