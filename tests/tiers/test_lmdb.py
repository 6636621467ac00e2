"""LMDB tier: exact LRU and eviction, pins, persistence across restart, parallel readers."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tiers import create_tier
from tiers.base import Evicted, TierError
from tiers.config import LmdbTierConfig
from tiers.lmdb import LmdbTier

VAL = 100  # bytes per value; capacity 400 holds exactly four


def _val(i: int, n: int = VAL) -> bytes:
    return bytes([i % 256]) * n


@pytest.fixture
def tier(tmp_path: Path) -> LmdbTier:
    t = LmdbTier(tmp_path / "db", capacity_bytes=4 * VAL)
    yield t
    t.close()


def test_put_get_usage_and_delete(tier: LmdbTier) -> None:
    assert tier.put_many([("a", _val(1)), ("b", memoryview(_val(2, 50)))]) == []
    assert tier.get_many(["a", "x", "b"]) == [_val(1), None, _val(2, 50)]
    u = tier.usage()
    assert (u.used_bytes, u.capacity_bytes, u.num_entries) == (150, 400, 2)
    assert tier.delete_many(["a", "x"]) == 1
    assert tier.lookup(["a"]) == 0 and tier.usage().used_bytes == 50
    assert tier.put_many([("huge", _val(3, 401))]) == [] and tier.lookup(["huge"]) == 0


def test_lru_order_and_eviction_at_capacity(tier: LmdbTier) -> None:
    tier.put_many([(k, _val(i)) for i, k in enumerate("abcd")])
    assert tier.lru_keys() == ["a", "b", "c", "d"]
    assert tier.lookup(["b", "a", "zz"]) == 2
    assert tier.get_many(["c"]) == [_val(2)]
    assert tier.lru_keys() == ["d", "b", "a", "c"]
    evicted = tier.put_many([("e", _val(4)), ("f", _val(5, 150))])
    # e evicts d; f (150 bytes) needs two more victims: b then a.
    assert evicted == [Evicted("d", _val(3)), Evicted("b", _val(1)), Evicted("a", _val(0))]
    assert tier.lru_keys() == ["c", "e", "f"]
    assert tier.usage().used_bytes == 350
    assert tier.put_many([("c", _val(9, 50))]) == []  # overwrite shrinks, refreshes
    assert tier.lru_keys() == ["e", "f", "c"] and tier.usage().used_bytes == 300


def test_pinned_entries_survive(tier: LmdbTier) -> None:
    tier.put_many([(k, _val(i)) for i, k in enumerate("abcd")])
    assert tier.pin(["a", "b", "nope", "c"]) == 2
    assert [e.key for e in tier.put_many([("e", _val(4)), ("f", _val(5))])] == ["c", "d"]
    assert tier.delete_many(["a"]) == 0
    tier.pin(["e", "f"])
    assert tier.put_many([("g", _val(6))]) == [] and tier.lookup(["g"]) == 0  # all pinned
    tier.unpin(["a", "b", "e", "f"])
    assert [e.key for e in tier.put_many([("g", _val(6))])] == ["a"]


def test_pin_each_pins_past_a_miss_and_counts_repeats(tier: LmdbTier) -> None:
    tier.put_many([(k, _val(i)) for i, k in enumerate("abcd")])
    assert tier.pin_each(["a", "x", "c", "c"]) == [True, False, True, True]
    tier.unpin(["c"])  # one of c's two pins
    assert [e.key for e in tier.put_many([("e", _val(4)), ("f", _val(5))])] == ["b", "d"]
    tier.unpin(["a", "c"])
    assert [e.key for e in tier.put_many([("g", _val(6))])] == ["a"]


def test_restart_keeps_contents_and_lru_order(tmp_path: Path) -> None:
    path = tmp_path / "db"
    first = LmdbTier(path, capacity_bytes=4 * VAL)
    first.put_many([(k, _val(i)) for i, k in enumerate("abcd")])
    first.get_many(["a"])  # refreshed on disk lazily: must survive close
    first.lookup(["c"])
    first.close()
    first.close()  # idempotent
    with pytest.raises(TierError, match="closed"):
        first.put_many([("x", b"1")])
    second = LmdbTier(path, capacity_bytes=4 * VAL)
    try:
        assert second.lru_keys() == ["b", "d", "a", "c"]
        assert second.get_many(list("abcd")) == [_val(i) for i in range(4)]
        assert second.usage().used_bytes == 400
        # get_many refreshed a, b, c, d in that order; the next eviction takes a.
        assert [e.key for e in second.put_many([("e", _val(4))])] == ["a"]
    finally:
        second.close()


def test_concurrent_readers_with_one_writer(tmp_path: Path) -> None:
    big = LmdbTier(tmp_path / "big", capacity_bytes=64 * VAL)
    hot = [f"hot{i}" for i in range(16)]
    big.put_many([(k, _val(i)) for i, k in enumerate(hot)])
    assert big.pin(hot) == 16
    errors: list[str] = []
    reads = [0]
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            for i, value in enumerate(big.get_many(hot)):
                if value != _val(i):
                    errors.append(f"hot{i}")
            reads[0] += 1

    readers = [threading.Thread(target=reader) for _ in range(3)]
    for t in readers:
        t.start()
    evicted: list[str] = []
    for i in range(100):  # one writer; 48 unpinned slots, so w0..w51 are evicted in order
        evicted += [e.key for e in big.put_many([(f"w{i}", _val(100 + i))])]
    stop.set()
    for t in readers:
        t.join()
    try:
        assert errors == [] and reads[0] > 0
        assert evicted == [f"w{i}" for i in range(52)]
        assert [k for k in big.lru_keys() if k.startswith("w")] == [f"w{i}" for i in range(52, 100)]
        assert big.get_many(["w51", "w52"]) == [None, _val(152)]
        assert big.usage().num_entries == 64
    finally:
        big.close()


def test_from_config_and_open_error(tmp_path: Path) -> None:
    tier = create_tier(LmdbTierConfig(path=str(tmp_path / "cfg"), capacity=1000))
    try:
        assert isinstance(tier, LmdbTier) and tier.usage().capacity_bytes == 1000
    finally:
        tier.close()
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises((TierError, OSError)):
        LmdbTier(blocker / "db", capacity_bytes=1000)


def test_lookup_and_pin_answer_while_a_write_transaction_holds_the_lock(tier: LmdbTier) -> None:
    """The engine looks up and pins on its step path: neither may wait for the writer, which
    holds the tier's lock for a whole write transaction (here held by the test instead)."""
    import threading

    tier.put_many([(k, _val(i)) for i, k in enumerate("abc")])
    got: list[int] = []

    def step_path() -> None:  # what the engine does for a request: look up, then pin
        got.append(tier.lookup(["c", "a", "zz", "b"]))
        got.append(tier.pin(["c", "a"]))

    with tier._lock:  # a write transaction in progress
        t = threading.Thread(target=step_path)
        t.start()
        t.join(5)
        assert not t.is_alive() and got == [2, 2]
    # the hits were queued, and count once the lock is free: c and a are now most recent
    assert tier.lru_keys() == ["b", "c", "a"]
    # and the pins hold: full at d, e evicts the least recent unpinned block, b
    assert tier.put_many([("d", _val(3))]) == []
    assert [e.key for e in tier.put_many([("e", _val(4))])] == ["b"]
    tier.unpin(["c", "a"])
    assert [e.key for e in tier.put_many([("f", _val(5))])] == ["c"]
