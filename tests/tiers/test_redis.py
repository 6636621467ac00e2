"""Redis tier specifics (the shared behaviour is in test_contract.py): URL handling, TTL, size
limit, cluster mode, server-reported usage and errors, and the tier-side LRU capacity (its
bookkeeping checked as stored in Redis), all against real redis-server processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tests.servers import RedisServer
from tiers.base import Evicted, TierError, TierUsage
from tiers.redis import RedisTier, RedisTierConfig, hiredis_active, redact_url


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A redis-server of this test alone (it gets killed or has a maxmemory)."""
    server = RedisServer(maxmemory_bytes=64 * 1024 * 1024)
    server.start()
    yield server
    server.cleanup()


def test_redis_fixture_flushes_and_restarts(redis_server: RedisServer, redis_url: str) -> None:
    client = redis_server.client()
    assert client.dbsize() == 0
    client.set("k", b"v")
    assert client.get("k") == b"v"
    if redis_server.managed:
        redis_server.kill()
        assert not redis_server.running
        redis_server.start()
        assert redis_server.client().get("k") is None  # no persistence: a restart starts empty


def test_hiredis_parser_is_active() -> None:
    assert hiredis_active()


def test_repr_and_errors_hide_the_password(redis_url: str) -> None:
    url = redis_url.replace("redis://", "redis://kv:s3cret@")
    assert redact_url(url) == redis_url.replace("redis://", "redis://kv:***@")
    tier = RedisTier(RedisTierConfig(url=url))
    assert "s3cret" not in repr(tier) and "kv:***@" in repr(tier)
    with pytest.raises(TierError) as err:  # the server has no such user
        tier.get_many(["a"])
    assert "s3cret" not in str(err.value)
    tier.close()


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="redis url must be"):
        RedisTierConfig(url="http://127.0.0.1:6379")
    with pytest.raises(ValueError, match="ttl_s"):
        RedisTierConfig(ttl_s=0)


def test_ttl_and_key_prefix(redis_server: RedisServer, redis_url: str) -> None:
    tier = RedisTier(RedisTierConfig(url=redis_url, ttl_s=30, key_prefix="t1:"))
    tier.put_many([("ns/a", b"x" * 10)])
    raw = redis_server.client()
    assert raw.keys("*") == [b"t1:ns/a"]
    assert 29_000 < raw.pttl("t1:ns/a") <= 30_000
    tier.close()


def test_oversize_values_are_skipped_and_counted(redis_url: str) -> None:
    tier = RedisTier(RedisTierConfig(url=redis_url, max_value_bytes=1000))
    assert tier.put_many([("a", b"x" * 1000), ("b", memoryview(b"y" * 1001)), ("c", b"z")]) == []
    assert tier.num_oversize_skipped == 1
    assert tier.get_many(["a", "b", "c"]) == [b"x" * 1000, None, b"z"]
    tier.close()


def test_usage_reports_maxmemory(private_redis: RedisServer) -> None:
    tier = RedisTier(RedisTierConfig(url=private_redis.url))
    usage = tier.usage()
    assert usage.capacity_bytes == 64 * 1024 * 1024 and usage.num_entries == 0
    tier.close()


def test_dead_server_raises_tier_error_fast_then_recovers(private_redis: RedisServer) -> None:
    tier = RedisTier(RedisTierConfig(url=private_redis.url, retries=0))
    tier.put_many([("a", b"1")])
    private_redis.kill()
    start = time.monotonic()
    for op in (
        lambda: tier.lookup(["a"]),
        lambda: tier.get_many(["a"]),
        lambda: tier.put_many([("b", b"2")]),
        lambda: tier.delete_many(["a"]),
        tier.usage,
    ):
        with pytest.raises(TierError):
            op()
    assert time.monotonic() - start < 2.0
    private_redis.start()  # empty again: no persistence
    assert tier.get_many(["a"]) == [None]
    tier.put_many([("a", b"3")])
    assert tier.get_many(["a"]) == [b"3"]
    tier.close()
    with pytest.raises(TierError, match="after close"):
        tier.lookup(["a"])


def test_cluster_url_uses_the_cluster_client() -> None:
    server = RedisServer(cluster=True)
    server.start()
    try:
        tier = RedisTier(RedisTierConfig(url=server.url))
        assert "cluster=True" in repr(tier)
        keys = [f"ns/{i:03d}" for i in range(40)]  # spread over many hash slots
        tier.put_many([(k, k.encode()) for k in keys])
        assert tier.lookup(keys + ["ns/none"]) == 40
        assert tier.get_many(["ns/007", "ns/none"]) == [b"ns/007", None]
        assert tier.delete_many(["ns/001", "ns/002", "ns/none"]) == 2
        assert tier.usage().num_entries == 38
        tier.close()
    finally:
        server.cleanup()


# -- capacity: LRU bookkeeping kept in Redis ----------------------------------------------


def _meta(redis_server: RedisServer, prefix: str = "kvtier:") -> tuple[list[bytes], dict, int]:
    """The bookkeeping as stored: keys least recent first, key -> size, the byte total."""
    raw = redis_server.client()
    try:
        order = raw.zrange(f"{prefix}@lru", 0, -1)
        sizes = {k: int(v) for k, v in raw.hgetall(f"{prefix}@sizes").items()}
        return order, sizes, int(raw.get(f"{prefix}@bytes") or 0)
    finally:
        raw.close()


def test_capacity_evicts_least_recently_used_with_values(
    redis_server: RedisServer, redis_url: str
) -> None:
    tier = RedisTier(RedisTierConfig(url=redis_url, capacity=300))
    assert tier.put_many([("a", b"a" * 100), ("b", b"b" * 100), ("c", b"c" * 100)]) == []
    assert tier.lookup(["a"]) == 1 and tier.get_many(["b", "zz"]) == [b"b" * 100, None]
    assert _meta(redis_server) == ([b"c", b"a", b"b"], {b"a": 100, b"b": 100, b"c": 100}, 300)
    assert tier.put_many([("d", memoryview(b"d" * 100))]) == [Evicted("c", b"c" * 100)]
    # An overwrite replaces its own bytes first and is never its own victim.
    assert tier.put_many([("a", b"A" * 150)]) == [Evicted("b", b"b" * 100)]
    assert tier.usage() == TierUsage(used_bytes=250, capacity_bytes=300, num_entries=2)
    # One call larger than what is left: oldest first, this call's own earlier values included.
    assert tier.put_many([("e", b"e" * 120), ("f", b"f" * 120), ("g", b"g" * 120)]) == [
        Evicted("d", b"d" * 100),
        Evicted("a", b"A" * 150),
        Evicted("e", b"e" * 120),
    ]
    assert tier.put_many([("big", b"x" * 301)]) == [] and tier.num_oversize_skipped == 1
    assert tier.lookup(["f", "g", "e"]) == 2 and tier.get_many(["big"]) == [None]
    assert tier.delete_many(["f", "nope"]) == 1
    assert _meta(redis_server) == ([b"g"], {b"g": 120}, 120)
    assert redis_server.client().get("kvtier:g") == b"g" * 120
    tier.close()


def test_capacity_forgets_keys_gone_behind_its_back(
    redis_server: RedisServer, redis_url: str
) -> None:
    tier = RedisTier(RedisTierConfig(url=redis_url, capacity=300))
    tier.put_many([("a", b"1" * 100), ("b", b"2" * 100), ("c", b"3" * 100)])
    raw = redis_server.client()
    raw.delete("kvtier:a", "kvtier:c")  # as a TTL expiry or the server's maxmemory would
    assert tier.get_many(["c"]) == [None]  # a read miss forgets c
    assert _meta(redis_server) == ([b"a", b"b"], {b"a": 100, b"b": 100}, 200)
    # Eviction reaches a (already gone): dropped from the books, not reported as an eviction.
    assert tier.put_many([("d", b"4" * 250)]) == [Evicted("b", b"2" * 100)]
    assert _meta(redis_server) == ([b"d"], {b"d": 250}, 250)
    raw.close()
    tier.close()


def test_capacity_is_shared_by_clients_and_survives_a_new_client(
    redis_server: RedisServer, redis_url: str
) -> None:
    """Four threads on two client objects write 4 x 40 distinct keys into room for 10: the
    scripts are atomic, so every key is either still there or evicted exactly once."""
    clients = [RedisTier(RedisTierConfig(url=redis_url, capacity=1000)) for _ in range(2)]
    evicted: list[Evicted] = []
    lock = threading.Lock()

    def worker(t: int) -> None:
        for i in range(40):
            out = clients[t % 2].put_many([(f"t{t}-{i:02d}", bytes([t]) * 100)])
            with lock:
                evicted.extend(out)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    order, sizes, total = _meta(redis_server)
    survivors = [k.decode() for k in order]
    written = {f"t{t}-{i:02d}" for t in range(4) for i in range(40)}
    assert len(survivors) == 10 and total == 1000 and set(sizes.values()) == {100}
    assert redis_server.client().dbsize() == 10 + 4  # the blocks and the four meta keys
    # Each evicted once, with its own bytes; evicted and surviving keys partition the writes.
    assert len(evicted) == 150 and len({e.key for e in evicted}) == 150
    assert {e.key for e in evicted} | set(survivors) == written
    assert all(e.value == bytes([int(e.key[1])]) * 100 for e in evicted)
    fresh = RedisTier(RedisTierConfig(url=redis_url, capacity=1000))  # the books are in Redis
    assert fresh.usage() == TierUsage(1000, 1000, 10)
    oldest = survivors[0]
    assert fresh.put_many([("new", b"n" * 100)]) == [Evicted(oldest, bytes([int(oldest[1])]) * 100)]
    for tier in [*clients, fresh]:
        tier.close()


def test_capacity_config_is_checked() -> None:
    with pytest.raises(ValueError, match="capacity must be positive"):
        RedisTierConfig(capacity=0)
    with pytest.raises(ValueError, match="'capacity' needs a single Redis server"):
        RedisTierConfig(url="redis+cluster://127.0.0.1:7000", capacity=100)
    with pytest.raises(ValueError, match="'capacity' needs a single Redis server"):
        RedisTierConfig(cluster=True, capacity=100)


def test_capacity_dead_server_raises_then_recovers_with_scripts_reloaded(
    private_redis: RedisServer,
) -> None:
    tier = RedisTier(RedisTierConfig(url=private_redis.url, capacity=200, retries=0))
    tier.put_many([("a", b"1" * 100)])
    private_redis.kill()
    for op in (
        lambda: tier.lookup(["a"]),
        lambda: tier.get_many(["a"]),
        lambda: tier.put_many([("b", b"2")]),
        lambda: tier.delete_many(["a"]),
        tier.usage,
    ):
        with pytest.raises(TierError):
            op()
    private_redis.start()  # empty, and without the cached scripts: EVALSHA falls back to EVAL
    assert tier.get_many(["a"]) == [None] and tier.usage() == TierUsage(0, 200, 0)
    assert tier.put_many([("a", b"3" * 150), ("b", b"4" * 100)]) == [Evicted("a", b"3" * 150)]
    tier.close()


def test_capacity_large_calls_are_chunked_and_keep_lru_semantics(
    redis_server: RedisServer, redis_url: str
) -> None:
    """75 items (more than one MULTI chunk) into room for 30, one key repeated, with a TTL: the
    result is what storing them one by one would give."""
    tier = RedisTier(RedisTierConfig(url=redis_url, capacity=300, ttl_s=30))
    tier.put_many([("old", b"o" * 10)])
    items = [(f"k{i:02d}", bytes([i]) * 10) for i in range(70)] + [("k05", b"new" * 3 + b"!")]
    items += [(f"m{i}", b"m" * 10) for i in range(4)]
    evicted = tier.put_many(items)
    # The repeat of k05 keeps its last value and its last position; 30 of 74 distinct keys fit.
    order = [f"k{i:02d}" for i in range(70) if i != 5] + ["k05"] + [f"m{i}" for i in range(4)]
    assert [e.key for e in evicted] == ["old", *order[:44]]
    assert evicted[0].value == b"o" * 10 and evicted[1] == Evicted("k00", bytes([0]) * 10)
    assert _meta(redis_server)[0] == [k.encode() for k in order[44:]]
    assert tier.get_many(["k05", "k69"]) == [b"newnewnew!", bytes([69]) * 10]
    raw = redis_server.client()
    assert 29_000 < raw.pttl("kvtier:k05") <= 30_000 and raw.dbsize() == 30 + 4
    raw.close()
    tier.close()
