"""Redis tier specifics (the shared behaviour is in test_contract.py): URL handling, TTL, size
limit, cluster mode, server-reported usage and errors, all against real redis-server processes."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.servers import RedisServer
from tiers.base import TierError
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
    for op in (lambda: tier.lookup(["a"]), lambda: tier.get_many(["a"]),
               lambda: tier.put_many([("b", b"2")]), lambda: tier.delete_many(["a"]), tier.usage):
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
