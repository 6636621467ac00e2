"""Redis tier specifics (the shared behaviour is in test_contract.py)."""

from __future__ import annotations

from tests.servers import RedisServer


def test_redis_fixture_flushes_and_restarts(redis_server: RedisServer, redis_url: str) -> None:
    client = redis_server.client()
    assert client.dbsize() == 0
    client.set("k", b"v")
    assert client.get("k") == b"v"
    if redis_server.managed:
        redis_server.kill()
        assert not redis_server.running
        redis_server.start()
        client = redis_server.client()
        assert client.get("k") is None  # no persistence: a restart starts empty
