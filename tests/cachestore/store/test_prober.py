"""Idle-tier probes (``GuardedTiers.probe_idle``, ``TierProber``): a tier no call reached for
the interval is pinged, a backing-off one is not, and a store's prober turns a killed real
redis-server into ``consecutive_failures`` and its restart back into 0 without any call."""

from __future__ import annotations

import time

import pytest

from cachestore.store.guarded_tiers import GuardedTiers
from cachestore.store.hierarchical import HierarchicalStore
from cachestore.store.types import StoreConfig
from tests.servers import free_port
from tiers.config import RedisTierConfig
from tiers.host import HostTier
from tiers.redis import RedisTier


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _redis(url: str) -> RedisTier:
    return RedisTier(
        RedisTierConfig(url=url, socket_timeout_s=0.5, connect_timeout_s=0.5, retries=0)
    )


def test_probe_idle_pings_idle_tiers_and_skips_backing_off_ones() -> None:
    pytest.importorskip("redis")
    clock = Clock()
    dead = _redis(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    tiers = GuardedTiers([HostTier(1 << 20, 4096), dead], StoreConfig(backoff_initial_s=1.0), clock)
    try:
        assert tiers.probe_idle(5.0) == []  # just made: not idle yet
        clock.now += 5.0
        assert tiers.probe_idle(5.0) == [0, 1]
        assert [h.consecutive_failures for h in tiers.health] == [0, 1]
        assert tiers.stats[1].snapshot()["errors"] == 1
        clock.now += 0.5  # redis backs off for 1 s; host was pinged 0.5 s ago
        assert tiers.probe_idle(0.2) == [0]
        assert tiers.stats[1].snapshot()["skipped"] == 0  # a probe never counts as skipped
        clock.now += 0.6  # past the backoff, 1.1 s after redis's failure, 0.6 s after host's ping
        assert tiers.probe_idle(5.0) == []
        assert tiers.probe_idle(1.0) == [1]
        assert [h.consecutive_failures for h in tiers.health] == [0, 2]
    finally:
        dead.close()


def _wait(check, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_store_prober_follows_a_killed_and_restarted_redis(redis_server) -> None:
    if not redis_server.managed:
        pytest.skip("needs a redis-server this test may kill")
    redis_server.ensure_running()
    store = HierarchicalStore(
        [HostTier(1 << 20, 4096), _redis(redis_server.url)],
        StoreConfig(probe_interval_s=0.1, backoff_initial_s=0.2, backoff_max_s=0.2),
    )
    try:

        def failures() -> int:
            return store.stats()["tiers"][1]["consecutive_failures"]

        time.sleep(0.3)
        assert failures() == 0
        redis_server.kill()
        _wait(lambda: failures() > 0, "the prober to find redis down", 5)
        redis_server.start()
        _wait(lambda: failures() == 0, "the prober to find redis back", 10)
    finally:
        store.close()
        redis_server.ensure_running()


def test_no_prober_without_an_interval() -> None:
    store = HierarchicalStore([HostTier(1 << 20, 4096)], StoreConfig(probe_interval_s=0))
    try:
        assert store._prober is None
    finally:
        store.close()
    with pytest.raises(ValueError, match="probe_interval_s"):
        StoreConfig(probe_interval_s=-1)
