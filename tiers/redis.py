"""Redis tier: encoded blocks as plain Redis strings, one key per block, batched by pipelines.

Two ways to bound it:

- ``capacity=None`` (default): the server owns capacity (``maxmemory`` and its eviction policy),
  so ``put_many`` never reports evictions and ``usage`` is what ``INFO memory`` and ``DBSIZE``
  say (best effort: they count every key of the database, not only kvtier's).
- ``capacity=N`` bytes of values: the tier keeps LRU bookkeeping IN Redis, next to the blocks
  (``tiers.redis_lru``), so that every client sharing the server sees one order; each write,
  read and delete is atomic on the server, so concurrent clients never overshoot the capacity
  or report one eviction twice. ``put_many`` evicts the least recently used keys before storing
  each value and returns them as ``Evicted`` with their bytes, so the store demotes them to the
  next tier (S3). Keys gone behind the bookkeeping's back (TTL expiry, the server's own
  maxmemory eviction) are forgotten when a read misses them or eviction reaches them. Set the
  server's ``maxmemory`` above ``capacity`` plus overhead so the server never evicts first. Not
  with ``cluster``: one script touches keys of many hash slots (bound each shard with
  ``maxmemory`` instead). A script that is retried after a lost reply may lose that call's
  evictions (counted by nobody; the blocks are gone).

- URLs: ``redis://``, ``rediss://`` (TLS) and ``unix://`` build one ``ConnectionPool``;
  ``redis+cluster://`` / ``rediss+cluster://`` (or ``cluster=True``) build a ``RedisCluster``.
  Block keys are independent, so no hash tags: a chain spreads over every shard, and batches
  go through the cluster pipeline, which splits them per node.
- Values over ``max_value_bytes`` (capped at Redis' 512 MiB ``proto-max-bulk-len``) are skipped
  and counted in ``num_oversize_skipped``; that is not an error.
- Every redis-py exception (and socket ``OSError``) becomes ``TierError``. Socket timeouts are
  explicit, retries few and short, so a dead server costs a request milliseconds, not seconds.
- redis-py's hiredis parser is expected; without it a warning is logged (parsing megabyte
  values in pure Python is several times slower).

- ``get_many`` splits a batch over ``read_connections`` pipelines on as many pooled connections,
  run in parallel (one round trip each), so a large read is not one socket's stream; a batch
  smaller than two keys per connection uses fewer. redis-py cannot parse a reply into a
  caller's buffer, so ``get_many_into`` is the protocol's default (one copy after the parse).

Thread-safe: redis-py pools hand each call its own connection; pipelines are per call.
``get_many`` returns ``bytes`` (never a memoryview), valid forever.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from tiers.base import Evicted, Tier, TierError, TierUsage, Value
from tiers.config import (  # noqa: F401  (RedisTierConfig: re-exported beside its tier)
    REDIS_CLUSTER_SCHEMES,
    REDIS_MAX_BULK_BYTES,
    RedisTierConfig,
    redact_url,
)
from tiers.redis_lru import RedisLru
from tiers.shared import backend_errors, nbytes

log = logging.getLogger(__name__)

_LOOKUP_BATCH = 64  # EXISTS per round trip in lookup; most chains stop well before this


def hiredis_active() -> bool:
    """Whether redis-py parses replies with hiredis (C) rather than pure Python."""
    from redis.utils import HIREDIS_AVAILABLE

    return bool(HIREDIS_AVAILABLE)


class RedisTier(Tier):
    """Tier over one Redis server or cluster. See the module docstring for semantics."""

    name = "redis"
    owns_read_values = True  # get_many returns bytes

    def __init__(self, config: RedisTierConfig) -> None:
        import redis
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        self.config = config
        self.max_value_bytes = min(config.max_value_bytes, REDIS_MAX_BULK_BYTES)
        self.num_oversize_skipped = 0  # racy increments are fine: a statistic, not a contract
        self.hiredis = hiredis_active()
        if not self.hiredis:
            log.warning("hiredis is not installed: redis-py parses replies in Python (slow); "
                        "pip install 'redis[hiredis]'")  # fmt: skip
        self._errors: tuple[type[BaseException], ...] = (
            redis.RedisError,
            redis.exceptions.RedisClusterException,
            OSError,
        )
        retry = Retry(ExponentialBackoff(cap=0.1, base=0.01), config.retries)
        common: dict[str, Any] = {
            "socket_timeout": config.socket_timeout_s,
            "socket_connect_timeout": config.connect_timeout_s,
            "retry": retry,
            "max_connections": config.max_connections,
        }
        scheme = urlsplit(config.url).scheme
        self._cluster = config.cluster or scheme in REDIS_CLUSTER_SCHEMES
        url = config.url
        if scheme in REDIS_CLUSTER_SCHEMES:
            url = urlunsplit(urlsplit(url)._replace(scheme=REDIS_CLUSTER_SCHEMES[scheme]))
        self._closed = False
        self._readers: ThreadPoolExecutor | None = None
        if config.read_connections > 1:
            self._readers = ThreadPoolExecutor(
                config.read_connections - 1, thread_name_prefix="kv-redis-read"
            )
        with backend_errors(self._errors, "redis", "connect", redact_url(config.url)):
            if self._cluster:
                # The cluster client connects at construction to learn the slot map.
                self._client: Any = redis.RedisCluster.from_url(url, **common)
            else:
                pool = redis.ConnectionPool.from_url(url, **common)
                self._client = redis.Redis(connection_pool=pool)
        self.capacity = config.capacity
        self._lru: RedisLru | None = None  # capacity mode: the LRU bookkeeping lives in Redis
        if config.capacity is not None:
            self.max_value_bytes = min(self.max_value_bytes, config.capacity)
            self._lru = RedisLru(self._client, config.key_prefix, config.capacity, self._guard)

    @classmethod
    def from_config(cls, config: RedisTierConfig) -> RedisTier:
        """Registry factory (``tiers.redis:RedisTier.from_config``)."""
        return cls(config)

    def __repr__(self) -> str:
        return (f"RedisTier(url={redact_url(self.config.url)!r}, cluster={self._cluster}, "
                f"capacity={self.capacity})")  # fmt: skip

    def _k(self, key: str) -> str:
        return self.config.key_prefix + key

    def _guard(self, op: str) -> AbstractContextManager[None]:
        return backend_errors(
            self._errors, "redis", op, f"on {redact_url(self.config.url)}", closed=self._closed
        )

    def _pipelined(
        self, op: str, keys: Sequence[str], add: Callable[[Any, str], object]
    ) -> list[Any]:
        if not keys:
            return []
        with self._guard(op):
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                add(pipe, self._k(key))
            return list(pipe.execute())

    def lookup(self, keys: Sequence[str]) -> int:
        """Leading keys present; EXISTS pipelined in batches, stopping at the batch of a miss.
        With ``capacity``: one script that also refreshes the recency of the keys it counts."""
        if self._lru is not None:
            return self._lru.lookup(keys)
        found = 0
        for start in range(0, len(keys), _LOOKUP_BATCH):
            batch = keys[start : start + _LOOKUP_BATCH]
            for exists in self._pipelined("lookup", batch, lambda p, k: p.exists(k)):
                if not exists:
                    return found
                found += 1
        return found

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """One pipelined EXISTS per key, one round trip; recency is not refreshed."""
        return [bool(n) for n in self._pipelined("lookup", keys, lambda p, k: p.exists(k))]

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        """One pipelined GET per key, the batch split over up to ``read_connections``
        pipelines in parallel (one round trip each; per node on a cluster). With ``capacity``
        each pipeline also runs the script that refreshes its hits' recency."""
        get = self._lru.get_many if self._lru is not None else self._get_pipelined
        parts = min(self.config.read_connections, len(keys) // 2)
        if parts <= 1 or self._readers is None or self._closed:  # closed: get raises TierError
            return get(keys)
        step = -(-len(keys) // parts)
        chunks = [keys[s : s + step] for s in range(0, len(keys), step)]
        # The calling thread reads the first chunk itself: one thread fewer to hand off to.
        try:
            futures = [self._readers.submit(get, c) for c in chunks[1:]]
        except RuntimeError:  # closed meanwhile: the pool takes no more work
            raise TierError(f"redis get on {redact_url(self.config.url)}: tier closed") from None
        out = get(chunks[0])
        for future in futures:
            out += future.result()
        return out

    def _get_pipelined(self, keys: Sequence[str]) -> list[Value | None]:
        return self._pipelined("get", keys, lambda p, k: p.get(k))

    def put_many(self, items: Sequence[tuple[str, Value]]) -> list[Evicted]:
        """SET each value (with ``EX``/``PX`` when ``ttl_s``); oversize ones are skipped.

        Without ``capacity`` nothing is evicted here (the server evicts silently). With it, the
        least recently used keys are evicted before each value is stored (a value of this very
        call included, if the call alone exceeds the capacity) and returned, oldest first, with
        their bytes. A key given twice keeps its last value. Raises TierError; a failed call may
        have stored (and evicted) part of it.
        """
        kept = [(k, v) for k, v in items if nbytes(v) <= self.max_value_bytes]
        self.num_oversize_skipped += len(items) - len(kept)
        if not kept:
            return []
        ttl_ms = None if self.config.ttl_s is None else max(1, round(self.config.ttl_s * 1000))
        if self._lru is not None:
            return self._lru.put_many(kept, ttl_ms)
        with self._guard("put"):
            pipe = self._client.pipeline(transaction=False)
            for key, value in kept:
                pipe.set(self._k(key), value, px=ttl_ms)
            pipe.execute()
        return []  # Redis evicts on its own (maxmemory-policy); it does not tell us what

    def delete_many(self, keys: Sequence[str]) -> int:
        if self._lru is not None:
            return self._lru.delete_many(keys)
        return sum(self._pipelined("delete", keys, lambda p, k: p.delete(k)))

    def ping(self) -> None:
        with self._guard("ping"):
            self._client.ping()

    def usage(self) -> TierUsage:
        """``used_memory`` and ``maxmemory`` (None when 0 = unlimited), summed over primaries;
        with ``capacity``: the tracked value bytes, the capacity and the tracked key count."""
        if self._lru is not None:
            return self._lru.usage()
        with self._guard("usage"):
            if self._cluster:
                from redis.cluster import RedisCluster

                infos = self._client.info("memory", target_nodes=RedisCluster.PRIMARIES)
                per_node = list(infos.values()) if isinstance(infos, dict) else [infos]
                if per_node and not isinstance(per_node[0], dict):
                    per_node = [infos]  # a single node answers with one flat dict
            else:
                per_node = [self._client.info("memory")]
            num_entries = int(self._client.dbsize())
        used = sum(int(info.get("used_memory", 0)) for info in per_node)
        maxmem = sum(int(info.get("maxmemory", 0)) for info in per_node)
        return TierUsage(used_bytes=used, capacity_bytes=maxmem or None, num_entries=num_entries)

    def close(self) -> None:
        """Disconnect every pooled connection. Idempotent; later calls raise TierError."""
        if self._closed:
            return
        self._closed = True
        if self._readers is not None:
            self._readers.shutdown(wait=True)
        try:
            self._client.close()
        except self._errors:
            pass  # closing a connection to a dead server has nothing left to release
