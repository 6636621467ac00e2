"""The Tier contract (tiers/base.py), checked identically on host, lmdb, redis and s3.

Every tier is built through the config parser and the registry (tests/tiers/conftest.py) and,
for redis and s3, talks to a real server started by the session fixtures.
"""

from __future__ import annotations

import random
import threading

import pytest

from cachestore.hashing import Namespace, block_key, hash_request_tokens
from tests.tiers.conftest import BOUNDED_KINDS, HOST_SLOT_BYTES, MIB, PERSISTENT_KINDS, MakeTier
from tiers.base import Tier, Value

KIB = 1024
NS = Namespace(model_fingerprint="contract-test")


def chain_keys(n: int, seed: int = 0) -> list[str]:
    """``n`` real block keys of one token chain (what the store passes to a tier)."""
    rng = random.Random(seed)
    tokens = [rng.randrange(50_000) for _ in range(n * NS.block_size)]
    return [block_key(NS, h) for h in hash_request_tokens(NS, tokens)]


def value(i: int, nbytes: int) -> bytes:
    return random.Random(i).randbytes(nbytes)


def as_bytes(v: Value | None) -> bytes | None:
    return None if v is None else bytes(v)


@pytest.mark.parametrize("nbytes", [64 * KIB, 2 * MIB], ids=["64KiB", "2MiB"])
@pytest.mark.parametrize("wrap", [bytes, memoryview], ids=["bytes", "memoryview"])
def test_put_get_round_trip(tier: Tier, nbytes: int, wrap: type) -> None:
    keys = chain_keys(3)
    vals = [value(i, nbytes) for i in range(3)]
    assert tier.put_many([(k, wrap(v)) for k, v in zip(keys, vals, strict=True)]) == []
    assert [as_bytes(v) for v in tier.get_many(keys)] == vals
    assert tier.contains(keys[1])


def test_owned_read_values_survive_later_calls(tier: Tier) -> None:
    """``owns_read_values``: a value held stays intact through later reads, writes and
    deletes (the store queues such views for promotion without copying them)."""
    if not tier.owns_read_values:
        pytest.skip(f"{tier.name}: views may die at the next call (copied by the store)")
    keys = chain_keys(4)
    tier.put_many([(k, value(i, 2 * MIB)) for i, k in enumerate(keys[:2])])
    held = tier.get_many(keys[:2])
    for _ in range(3):
        tier.get_many(keys[:2])
    tier.put_many([(k, value(9, 2 * MIB)) for k in keys[2:]])
    tier.get_many(keys[2:])
    tier.delete_many(keys[:2])
    assert [as_bytes(v) for v in held] == [value(0, 2 * MIB), value(1, 2 * MIB)]


def test_lookup_counts_the_leading_run_only(tier: Tier) -> None:
    keys = chain_keys(6)
    tier.put_many([(keys[i], value(i, 1000)) for i in (0, 1, 2, 4, 5)])  # a gap at 3
    assert tier.lookup(keys) == 3
    assert tier.lookup(keys[:2]) == 2
    assert tier.lookup(keys[3:]) == 0
    assert tier.lookup(keys[4:]) == 2
    assert tier.lookup([keys[5], keys[0]]) == 2  # keys out of chain order still count
    assert tier.lookup([]) == 0
    assert not tier.contains(keys[3])


def test_contains_many_answers_each_key_past_a_gap(tier: Tier) -> None:
    keys = chain_keys(6)
    tier.put_many([(keys[i], value(i, 1000)) for i in (0, 1, 4)])
    assert tier.contains_many(keys) == [True, True, False, False, True, False]
    assert tier.contains_many([keys[4], keys[3], keys[0]]) == [True, False, True]
    assert tier.contains_many([]) == []


def test_get_many_keeps_order_and_returns_none_for_misses(tier: Tier) -> None:
    keys = chain_keys(4)
    tier.put_many([(keys[0], value(0, 3000)), (keys[2], value(2, 5000))])
    got = [as_bytes(v) for v in tier.get_many([keys[2], keys[1], keys[0], keys[3]])]
    assert got == [value(2, 5000), None, value(0, 3000), None]
    assert tier.get_many([]) == []


def test_delete_many_counts_present_keys(tier: Tier) -> None:
    keys = chain_keys(4)
    tier.put_many([(k, value(i, 2000)) for i, k in enumerate(keys[:3])])
    assert tier.delete_many([keys[0], keys[3], keys[2]]) == 2
    assert [as_bytes(v) for v in tier.get_many(keys)] == [None, value(1, 2000), None, None]
    assert tier.lookup(keys[1:]) == 1
    assert tier.delete_many([keys[0], keys[2]]) == 0
    assert tier.delete_many([]) == 0


def test_overwrite_replaces_the_value(tier: Tier) -> None:
    keys = chain_keys(2)
    tier.put_many([(keys[0], value(1, 4000)), (keys[1], value(2, 4000))])
    tier.put_many([(keys[0], value(3, 7000))])
    assert [as_bytes(v) for v in tier.get_many(keys)] == [value(3, 7000), value(2, 4000)]
    assert tier.usage().num_entries == 2


def test_usage_reports_entries_and_bytes(tier: Tier, tier_kind: str) -> None:
    empty = tier.usage()
    assert empty.num_entries == 0
    keys = chain_keys(5)
    tier.put_many([(k, value(i, 64 * KIB)) for i, k in enumerate(keys)])
    usage = tier.usage()
    assert usage.num_entries == 5
    assert usage.used_bytes >= 5 * 64 * KIB
    if tier_kind in BOUNDED_KINDS:
        assert usage.capacity_bytes is not None and usage.used_bytes <= usage.capacity_bytes
    else:
        assert usage.capacity_bytes is None  # server-managed; no maxmemory on the test server


def test_close_is_idempotent(make_tier: MakeTier) -> None:
    tier = make_tier()
    tier.put_many([(chain_keys(1)[0], b"x" * 100)])
    tier.close()
    tier.close()
    with make_tier() as other:  # the context manager closes too
        assert other.lookup(chain_keys(1, seed=9)) == 0


def test_concurrent_threads_see_their_own_writes(tier: Tier) -> None:
    num_threads, per_thread, nbytes = 4, 6, 16 * KIB  # 24 entries: fits the 32-slot host tier
    errors: list[BaseException] = []
    barrier = threading.Barrier(num_threads)

    def worker(t: int) -> None:
        try:
            keys = chain_keys(per_thread, seed=100 + t)
            vals = [value(1000 * t + i, nbytes) for i in range(per_thread)]
            barrier.wait()
            for round_ in range(3):
                tier.put_many(list(zip(keys, vals, strict=True)))
                assert tier.lookup(keys) == per_thread
                assert [as_bytes(v) for v in tier.get_many(keys)] == vals, f"round {round_}"
        except BaseException as exc:  # collected: an assert in a thread would be lost
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(num_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors, errors[0]
    assert tier.usage().num_entries == num_threads * per_thread


def test_eviction_at_capacity_returns_oldest_keys(make_tier: MakeTier, tier_kind: str) -> None:
    if tier_kind == "s3":
        pytest.skip("s3: no capacity; a bucket lifecycle rule bounds it")
    nbytes = 64 * KIB
    # Room for four values in the host slab; for LMDB and Redis (optional ``capacity``, LRU
    # kept in Redis) a capacity of about four values.
    capacity = 4 * HOST_SLOT_BYTES if tier_kind == "host" else 4 * nbytes + 16 * KIB
    tier = make_tier(capacity=f"{capacity}B")
    keys = chain_keys(10)
    evicted = []
    for i, k in enumerate(keys):
        evicted += tier.put_many([(k, value(i, nbytes))])
    evicted_keys = [e.key for e in evicted]
    assert evicted_keys == keys[: len(evicted_keys)]  # LRU: oldest first, in order
    assert len(evicted_keys) >= 10 - 4
    for e in evicted:
        assert e.value is None or bytes(e.value) == value(keys.index(e.key), nbytes)
    survivors = keys[len(evicted_keys) :]
    assert tier.lookup(survivors) == len(survivors)
    assert tier.get_many(evicted_keys) == [None] * len(evicted_keys)
    usage = tier.usage()
    assert usage.num_entries == len(survivors) and usage.used_bytes <= capacity
    if tier_kind in ("host", "redis"):
        assert evicted_keys == keys[:6]  # exactly four slots / four values' bytes
    if tier_kind == "redis":  # values counted exactly, and always handed over for demotion
        assert usage.used_bytes == 4 * nbytes
        assert [bytes(e.value or b"") for e in evicted] == [value(i, nbytes) for i in range(6)]


def test_lookup_refreshes_recency_for_lru_tiers(make_tier: MakeTier, tier_kind: str) -> None:
    if tier_kind not in ("host", "redis"):
        pytest.skip(
            f"{tier_kind}: exact LRU order is asserted for host and redis with capacity "
            "(lmdb: tests/tiers/test_lmdb)"
        )
    tier = make_tier(capacity=f"{3 * HOST_SLOT_BYTES}B" if tier_kind == "host" else "3000B")
    keys = chain_keys(4)
    tier.put_many([(k, value(i, 1000)) for i, k in enumerate(keys[:3])])
    assert tier.lookup(keys[:1]) == 1  # keys[0] becomes most recent
    evicted = tier.put_many([(keys[3], value(3, 1000))])
    assert [e.key for e in evicted] == [keys[1]]


def test_a_new_client_sees_what_an_old_one_wrote(make_tier: MakeTier, tier_kind: str) -> None:
    if tier_kind not in PERSISTENT_KINDS:
        pytest.skip(f"{tier_kind}: memory of one process, gone with the tier object")
    keys = chain_keys(20)
    vals = [value(i, 32 * KIB) for i in range(20)]
    first = make_tier()
    first.put_many(list(zip(keys, vals, strict=True)))
    first.close()
    second = make_tier()
    assert second.lookup(keys) == 20
    assert [as_bytes(v) for v in second.get_many(keys)] == vals
    assert second.usage().num_entries == 20
