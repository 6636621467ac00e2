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


def _in_another_process(path: Path, capacity: int, code: str) -> None:
    """Run ``code`` with ``tier`` an LmdbTier on ``path`` in a fresh Python process (the way a
    second engine, or another rank, opens the same directory)."""
    import subprocess
    import sys

    prog = (
        "from tiers.lmdb import LmdbTier\n"
        f"tier = LmdbTier({str(path)!r}, capacity_bytes={capacity})\n"
        "v = lambda i, n=100: bytes([i % 256]) * n\n"
        f"{code}\n"
        "tier.close()\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", prog], check=True, cwd=root, timeout=60)


def _directory_bytes(tier: LmdbTier) -> tuple[int, int]:
    """(sum of the stored values' sizes, the directory's own count of them), read afresh
    through ``tier``'s environment (a process opens one environment once)."""
    from tiers.lmdb_writer import SEQ, USED

    with tier._env.begin() as txn:
        total = sum(len(v) for _, v in txn.cursor(db=tier._blocks))
        counted = SEQ.unpack(txn.get(USED, db=tier._meta))[0]
    return total, counted


def test_blocks_another_process_writes_are_found_while_both_are_open(tmp_path: Path) -> None:
    """Two engines of one machine share the default LMDB directory: what one stores, the
    other finds without a restart (its index was built when it opened)."""
    path = tmp_path / "db"
    tier = LmdbTier(path, capacity_bytes=10 * VAL)
    try:
        tier.put_many([("mine", _val(9))])
        _in_another_process(
            path, 10 * VAL, "tier.put_many([(k, v(i)) for i, k in enumerate('abcd')])"
        )
        assert tier.lookup(["a", "b", "c", "d", "zz"]) == 4
        assert tier.holds_hint("c") and tier.pin(["a", "b"]) == 2
        tier.unpin(["a", "b"])
        assert tier.get_many(["b", "d"]) == [_val(1), _val(3)]
        assert tier.contains_many(["d", "zz", "mine"]) == [True, False, True]
        assert set(tier.lru_keys()) == {"mine", "a", "b", "c", "d"}
        assert tier.usage().used_bytes == 5 * VAL
    finally:
        tier.close()


def test_the_capacity_bounds_every_process_s_blocks_together(tmp_path: Path) -> None:
    """Each process evicts its own least recent blocks until the directory's count, not its
    own, is within the capacity. Before, each counted only its own writes: two engines held
    twice the capacity, and past the map's size every write failed with MDB_MAP_FULL."""
    path = tmp_path / "db"
    tier = LmdbTier(path, capacity_bytes=4 * VAL)
    try:
        tier.put_many([("a", _val(0)), ("b", _val(1))])
        # The other process opens (its index has a and b) and writes three more: it evicts
        # the least recent block it knows, a, to stay within the 4 values.
        _in_another_process(
            path, 4 * VAL, "tier.put_many([(k, v(i)) for i, k in enumerate('cde')])"
        )
        assert _directory_bytes(tier) == (4 * VAL, 4 * VAL)
        assert tier.get_many(["a"]) == [None]  # gone under this process's index
        # This process writes two more: it evicts what it knows (b; a was already gone) and
        # then the blocks it found the other process wrote.
        assert tier.lookup(["c", "d", "e"]) == 3
        evicted = tier.put_many([("f", _val(5)), ("g", _val(6))])
        assert [e.key for e in evicted] == ["b", "c"]
        assert "a" not in tier.lru_keys()
        assert _directory_bytes(tier) == (4 * VAL, 4 * VAL)
        assert tier.usage().used_bytes == 4 * VAL
    finally:
        tier.close()


def test_a_process_that_never_saw_the_other_s_blocks_still_makes_room(tmp_path: Path) -> None:
    """B opened an empty directory; A filled it since. B's own index has no victim, so it
    takes in A's blocks as its least recent ones and evicts them (before, its put was
    dropped: nothing of its own to evict)."""
    path = tmp_path / "db"
    tier = LmdbTier(path, capacity_bytes=4 * VAL)
    try:
        _in_another_process(
            path, 4 * VAL, "tier.put_many([(k, v(i)) for i, k in enumerate('abcd')])"
        )
        evicted = tier.put_many([("mine", _val(9))])
        assert len(evicted) == 1 and evicted[0].key in "abcd"
        assert tier.lookup(["mine"]) == 1 and tier.get_many(["mine"]) == [_val(9)]
        assert _directory_bytes(tier) == (4 * VAL, 4 * VAL)
    finally:
        tier.close()


def test_the_directory_s_count_is_recounted_on_open(tmp_path: Path) -> None:
    """A directory written without the count (an older kvtier), or with one that drifted, is
    counted afresh when a tier opens it, so the capacity bounds what is really there."""
    import subprocess
    import sys

    path = tmp_path / "db"
    prog = (
        "import lmdb\n"
        f"env = lmdb.open({str(path)!r}, max_dbs=3, map_size=1 << 24)\n"
        "blocks, meta = env.open_db(b'blocks'), env.open_db(b'meta')\n"
        "with env.begin(write=True) as txn:\n"
        "    for k in (b'a', b'b', b'c'):\n"
        "        txn.put(k, bytes(100), db=blocks)\n"
        "    txn.put(b'used_bytes', (0).to_bytes(8, 'little'), db=meta)\n"  # a stale count
        "env.close()\n"
    )
    subprocess.run([sys.executable, "-c", prog], check=True, timeout=60)
    tier = LmdbTier(path, capacity_bytes=4 * VAL)
    try:
        assert tier.usage().used_bytes == 3 * VAL and _directory_bytes(tier) == (300, 300)
        assert [e.key for e in tier.put_many([("d", _val(3)), ("e", _val(4))])] == ["a"]
    finally:
        tier.close()
