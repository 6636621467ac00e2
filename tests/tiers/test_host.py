"""Host tier: slot accounting, exact LRU order, eviction with bytes, pins, direct writes."""

from __future__ import annotations

import threading

import pytest

from tiers import create_tier
from tiers.base import Evicted
from tiers.config import HostTierConfig
from tiers.host import HostTier

SLOT = 64


def _val(i: int, n: int = SLOT) -> bytes:
    return bytes([i % 256]) * n


@pytest.fixture
def tier() -> HostTier:
    t = HostTier(capacity_bytes=4 * SLOT + 10, slot_bytes=SLOT)  # 4 slots; 10 bytes unused
    yield t
    t.check_integrity()
    t.close()


def test_allocation_and_usage(tier: HostTier) -> None:
    assert tier.num_slots == 4
    assert not tier.pinned_memory  # no CUDA on the test machine
    assert tier.slab_tensor().numel() == 4 * SLOT
    assert tier.put_many([("a", _val(1, 10)), ("b", _val(2))]) == []
    u = tier.usage()
    assert (u.used_bytes, u.capacity_bytes, u.num_entries) == (10 + SLOT, 4 * SLOT, 2)
    with pytest.raises(ValueError, match="capacity >= slot_bytes"):
        HostTier(capacity_bytes=10, slot_bytes=SLOT)


def test_get_returns_zero_copy_views_into_the_slab(tier: HostTier) -> None:
    tier.put_many([("a", _val(7, 5))])
    (view,) = tier.get_many(["a"])
    assert isinstance(view, memoryview) and bytes(view) == b"\x07" * 5
    tier.slab_tensor()[0] = 99  # slot 0 holds "a": the view sees the slab
    assert view[0] == 99
    assert tier.get_many(["zz", "a"])[0] is None


def test_lru_order_and_eviction_returns_keys_and_bytes(tier: HostTier) -> None:
    tier.put_many([(k, _val(i)) for i, k in enumerate("abcd")])
    assert tier.lru_keys() == ["a", "b", "c", "d"]
    assert tier.lookup(["b"]) == 1 and tier.get_many(["a"])[0] is not None
    assert tier.lru_keys() == ["c", "d", "b", "a"]
    evicted = tier.put_many([("e", _val(10)), ("f", _val(11))])
    assert evicted == [Evicted("c", _val(2)), Evicted("d", _val(3))]
    assert tier.lru_keys() == ["b", "a", "e", "f"]
    assert tier.lookup(["b", "a", "c", "e"]) == 2  # refreshes b then a, stops at c
    assert tier.lru_keys() == ["e", "f", "b", "a"]
    assert tier.put_many([("b", _val(20))]) == []  # overwrite in place, refresh
    assert tier.lru_keys() == ["e", "f", "a", "b"]
    assert bytes(tier.get_many(["b"])[0]) == _val(20)


def test_pin_each_pins_past_a_miss_and_counts_repeats(tier: HostTier) -> None:
    tier.put_many([(k, _val(i)) for i, k in enumerate("abcd")])
    assert tier.pin_each(["a", "x", "c", "c"]) == [True, False, True, True]
    assert tier.pin_each([]) == []
    tier.unpin(["c"])  # one of c's two pins
    evicted = tier.put_many([("e", _val(4)), ("f", _val(5)), ("g", _val(6))])
    assert [e.key for e in evicted] == ["b", "d", "e"]
    tier.unpin(["a", "c"])
    assert [e.key for e in tier.put_many([("h", _val(7))])] == ["a"]


def test_contains_many_answers_past_a_miss_refreshes_hits_and_skips_reservations(
    tier: HostTier,
) -> None:
    """One lock hold for the batch (the store's prepare_store asks it for every save):
    a committed key is present and refreshed as ``lookup`` refreshes it; a reserved one is not
    present until committed."""
    tier.put_many([(k, _val(i)) for i, k in enumerate("abc")])
    assert tier.reserve("r", 8) is not None
    assert tier.contains_many(["a", "x", "c", "r"]) == [True, False, True, False]
    assert tier.contains_many([]) == []
    assert tier.lru_keys() == ["b", "a", "c"]  # a then c refreshed; the reservation unlisted
    assert tier.commit("r") and tier.contains_many(["r"]) == [True]


def test_pinned_entries_survive_and_what_cannot_be_placed_is_handed_back(tier: HostTier) -> None:
    tier.put_many([(k, _val(i)) for i, k in enumerate("abcd")])
    assert tier.pin(["a", "b", "x", "c"]) == 2
    evicted = tier.put_many([("e", _val(4)), ("f", _val(5)), ("g", _val(6))])
    assert [e.key for e in evicted] == ["c", "d", "e"]
    assert tier.lru_keys() == ["a", "b", "f", "g"]
    assert tier.delete_many(["a", "f", "nope"]) == 1  # a is pinned: stays
    assert tier.put_many([("h", _val(7))]) == []  # takes f's freed slot
    assert tier.pin(["g", "h"]) == 2
    # Every slot pinned: "i" cannot be placed, and comes back with its bytes (the store passes
    # it down to the next tier like an eviction: a save is never silently lost).
    assert tier.put_many([("i", _val(8))]) == [Evicted("i", _val(8))]
    assert tier.num_full_skipped == 1 and tier.lookup(["i"]) == 0
    tier.unpin(["b", "a"])
    assert [e.key for e in tier.put_many([("i", _val(8))])] == ["a"]  # a is older than b
    assert tier.put_many([("big", _val(1, SLOT + 1))]) == [Evicted("big", _val(1, SLOT + 1))]
    assert tier.num_oversize_skipped == 1


def test_reserve_commit_abort(tier: HostTier) -> None:
    res = tier.reserve("r", 8)
    assert res is not None and res.offset % SLOT == 0 and res.evicted == []
    res.view[:] = b"12345678"
    assert tier.lookup(["r"]) == 0 and tier.get_many(["r"]) == [None]  # invisible until commit
    assert tier.reserve("r", 8) is None
    assert tier.commit("r") and not tier.commit("r")
    assert bytes(tier.get_many(["r"])[0]) == b"12345678"
    assert bytes(tier.slab_tensor()[res.offset : res.offset + 8].numpy()) == b"12345678"
    res2 = tier.reserve("s", 4)
    assert res2 is not None
    tier.abort("s")
    assert tier.usage().num_entries == 1 and tier.usage().used_bytes == 8
    assert tier.reserve("t", SLOT + 1) is None


def test_reserved_slots_are_not_evicted(tier: HostTier) -> None:
    reservations = [tier.reserve(k, SLOT) for k in "abcd"]
    assert all(r is not None for r in reservations)
    assert tier.put_many([("e", _val(1))]) == [Evicted("e", _val(1))]  # handed back, not lost
    assert tier.lookup(["e"]) == 0


def test_from_config_via_registry() -> None:
    tier = create_tier(HostTierConfig(capacity=1024, slot_bytes=256))
    assert isinstance(tier, HostTier) and tier.num_slots == 4
    with pytest.raises(ValueError, match="needs slot_bytes"):
        create_tier(HostTierConfig(capacity=1024))


def test_concurrent_writers_and_readers_keep_accounting_exact() -> None:
    tier = HostTier(capacity_bytes=16 * SLOT, slot_bytes=SLOT)
    errors: list[str] = []

    def writer(w: int) -> None:
        for i in range(200):
            tier.put_many([(f"{w}-{i}", _val(i))])

    def reader() -> None:
        for _ in range(200):
            for view in tier.get_many([f"0-{i}" for i in range(0, 200, 17)]):
                if view is not None and len(view) != SLOT:
                    errors.append("bad length")

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    tier.check_integrity()
    assert tier.usage().num_entries == 16


def test_locate_checks_size_and_header_and_pins_on_request(tier: HostTier) -> None:
    header = b"HDR1"
    tier.put_many(
        [
            ("a", header + _val(1, SLOT - 4)),
            ("b", b"XXXX" + _val(2, SLOT - 4)),
            ("c", header + _val(3, 10)),
        ]
    )
    assert tier.reserve("d", SLOT) is not None  # reserved: invisible to locate
    assert tier.locate(["a", "b", "c", "d", "zz"], header, SLOT) == [0, None, None, None, None]
    # a's slot is slot 0 (first free); with pin=True it cannot be evicted or deleted.
    assert tier.locate(["a"], header, SLOT, pin=True) == [0]
    tier.commit("d")
    assert tier.delete_many(["a"]) == 0
    evicted = tier.put_many([("e", _val(5)), ("f", _val(6))])
    assert "a" not in [e.key for e in evicted] and tier.lookup(["a"]) == 1
    assert bytes(tier.get_many(["a"])[0]) == header + _val(1, SLOT - 4)
    tier.unpin(["a"])
    assert tier.delete_many(["a"]) == 1
