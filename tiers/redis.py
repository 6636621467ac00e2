"""Redis tier: encoded blocks as plain Redis strings, one key per block, batched by pipelines.

Two ways to bound it:

- ``capacity=None`` (default): the server owns capacity (``maxmemory`` and its eviction policy),
  so ``put_many`` never reports evictions and ``usage`` is what ``INFO memory`` and ``DBSIZE``
  say (best effort: they count every key of the database, not only kvtier's).
- ``capacity=N`` bytes of values: the tier keeps LRU bookkeeping IN Redis, next to the blocks,
  so that every client sharing the server sees one order: a sorted set ``{prefix}@lru`` (key ->
  access sequence from the counter ``{prefix}@seq``), a hash ``{prefix}@sizes`` (key -> value
  bytes) and a running total ``{prefix}@bytes``. A write is one MULTI: a Lua script that
  updates the bookkeeping and evicts, then the SETs; reads (which refresh recency) and deletes
  run small scripts. Each is atomic on the server, so concurrent clients never overshoot the
  capacity or report one eviction twice, and values never pass through Lua. ``put_many`` evicts
  the least recently used keys before storing each value and returns them as ``Evicted`` with
  their bytes (GET, then DEL, in the script), so the store demotes them to the next tier (S3). Keys gone behind the
  bookkeeping's back (TTL expiry, the server's own maxmemory eviction) are forgotten when a
  read misses them or eviction reaches them. Set the server's ``maxmemory`` above ``capacity``
  plus overhead so the server never evicts first. Not with ``cluster``: one script touches keys
  of many hash slots (bound each shard with ``maxmemory`` instead). A script that is retried
  after a lost reply may lose that call's evictions (counted by nobody; the blocks are gone).

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

Thread-safe: redis-py pools hand each call its own connection; pipelines are per call.
``get_many`` returns ``bytes`` (never a memoryview), valid forever.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from tiers.base import Evicted, Tier, TierError, TierUsage, Value

log = logging.getLogger(__name__)

REDIS_MAX_BULK_BYTES = 512 * 1024 * 1024  # Redis' default proto-max-bulk-len
_LOOKUP_BATCH = 64  # EXISTS per round trip in lookup; most chains stop well before this
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
T = TypeVar("T")

# The LRU scripts (capacity mode). KEYS: @lru zset, @sizes hash, @bytes total, @seq counter.
# Block keys are passed in ARGV, without the prefix, so the bookkeeping stores them bare. Values
# never pass through Lua (a copy into and out of a Lua string halves throughput): the admit
# script runs first in a MULTI whose SETs follow it, so the whole put is atomic on the server.
_LUA_FORGET = """
local function forget(key)
  local size = redis.call('HGET', KEYS[2], key)
  if size then
    redis.call('HDEL', KEYS[2], key)
    redis.call('ZREM', KEYS[1], key)
    redis.call('DECRBY', KEYS[3], size)
  end
end
"""
# ARGV: capacity, prefix, n_drop, n_drop keys to delete (this call's items that its later items
# evict at once), then key1, size1, key2, size2, ... to admit, evicting the least recent keys
# first. Returns victim1, value1, ... (GET before DEL; victims already gone are omitted).
_LUA_ADMIT = _LUA_FORGET + """
local cap, pre, ndrop = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
for i = 4, 3 + ndrop do
  redis.call('DEL', pre .. ARGV[i])
  forget(ARGV[i])
end
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
local out = {}
for i = 4 + ndrop, #ARGV, 2 do
  local key, size = ARGV[i], tonumber(ARGV[i + 1])
  local old = redis.call('HGET', KEYS[2], key)
  if old then  -- an overwrite: its old bytes leave first, and it is never its own victim
    total = total - tonumber(old)
    redis.call('ZREM', KEYS[1], key)
  end
  while total + size > cap do
    local victim = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
    if not victim then break end
    local bytes = redis.call('GET', pre .. victim)
    redis.call('DEL', pre .. victim)
    total = total - tonumber(redis.call('HGET', KEYS[2], victim) or '0')
    redis.call('HDEL', KEYS[2], victim)
    redis.call('ZREM', KEYS[1], victim)
    if bytes then
      out[#out + 1] = victim
      out[#out + 1] = bytes
    end
  end
  redis.call('HSET', KEYS[2], key, size)
  redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[4]), key)
  total = total + size
end
redis.call('SET', KEYS[3], total)
return out
"""
# ARGV: mode ('touch' | 'lookup'), prefix, keys... A present key gets a fresh recency (tracked
# keys only); an absent one is forgotten. 'lookup' stops at the first absent key and returns
# how many came before it; 'touch' (after a pipelined GET) visits every key.
_LUA_TOUCH = _LUA_FORGET + """
local lookup, pre = ARGV[1] == 'lookup', ARGV[2]
for i = 3, #ARGV do
  local key = ARGV[i]
  if redis.call('EXISTS', pre .. key) == 1 then
    if redis.call('ZSCORE', KEYS[1], key) then
      redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[4]), key)
    end
  else
    forget(key)
    if lookup then return i - 3 end
  end
end
return #ARGV - 2
"""
# ARGV: prefix, keys... Returns how many keys existed.
_LUA_DELETE = _LUA_FORGET + """
local n = 0
for i = 2, #ARGV do
  n = n + redis.call('DEL', ARGV[1] .. ARGV[i])
  forget(ARGV[i])
end
return n
"""
_PUT_CHUNK = 32  # items per put script: bounds one script's run time and argument size


@dataclass(frozen=True, slots=True)
class RedisTierConfig:
    """One Redis (or Redis Cluster) tier. ``url`` may carry credentials; repr hides them."""

    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    key_prefix: str = "kvtier:"  # lets kvtier share a database and be scanned/flushed apart
    ttl_s: float | None = None  # None: keep until the server evicts (maxmemory policy)
    max_value_bytes: int = REDIS_MAX_BULK_BYTES
    socket_timeout_s: float = 2.0
    connect_timeout_s: float = 1.0
    max_connections: int = 64
    retries: int = 1  # on connection errors/timeouts, with a 10-100 ms backoff
    capacity: int | None = None  # bytes of values; None: the server's maxmemory bounds the tier

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in {"redis", "rediss", "unix", *_CLUSTER_SCHEMES}:
            raise ValueError(f"redis url must be redis://, rediss://, unix:// or "
                             f"redis+cluster://, got {redact_url(self.url)!r}")  # fmt: skip
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {self.ttl_s}")
        if self.max_value_bytes <= 0:
            raise ValueError(f"max_value_bytes must be positive, got {self.max_value_bytes}")
        if self.socket_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("socket_timeout_s and connect_timeout_s must be positive")
        if self.max_connections <= 0 or self.retries < 0:
            raise ValueError("max_connections must be positive and retries non-negative")
        if self.capacity is not None and self.capacity <= 0:
            raise ValueError(f"capacity must be positive or None, got {self.capacity}")
        if self.capacity is not None and (self.cluster or scheme in _CLUSTER_SCHEMES):
            raise ValueError("capacity needs a single Redis server (its LRU scripts touch keys "
                             "in many hash slots); bound a cluster with maxmemory per shard")


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs and repr)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def hiredis_active() -> bool:
    """Whether redis-py parses replies with hiredis (C) rather than pure Python."""
    from redis.utils import HIREDIS_AVAILABLE

    return bool(HIREDIS_AVAILABLE)


class RedisTier(Tier):
    """Tier over one Redis server or cluster. See the module docstring for semantics."""

    name = "redis"

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
            redis.RedisError, redis.exceptions.RedisClusterException, OSError
        )
        retry = Retry(ExponentialBackoff(cap=0.1, base=0.01), config.retries)
        common: dict[str, Any] = {
            "socket_timeout": config.socket_timeout_s,
            "socket_connect_timeout": config.connect_timeout_s,
            "retry": retry,
            "max_connections": config.max_connections,
        }
        scheme = urlsplit(config.url).scheme
        self._cluster = config.cluster or scheme in _CLUSTER_SCHEMES
        url = config.url
        if scheme in _CLUSTER_SCHEMES:
            url = urlunsplit(urlsplit(url)._replace(scheme=_CLUSTER_SCHEMES[scheme]))
        self._closed = False
        try:
            if self._cluster:
                # The cluster client connects at construction to learn the slot map.
                self._client: Any = redis.RedisCluster.from_url(url, **common)
            else:
                pool = redis.ConnectionPool.from_url(url, **common)
                self._client = redis.Redis(connection_pool=pool)
        except self._errors as exc:
            raise TierError(f"redis connect {redact_url(config.url)}: {exc}") from exc
        self.capacity = config.capacity
        if config.capacity is not None:
            self.max_value_bytes = min(self.max_value_bytes, config.capacity)
            # register_script loads nothing yet: EVALSHA, falling back to EVAL after a restart.
            self._admit_script = self._client.register_script(_LUA_ADMIT)
            self._touch_script = self._client.register_script(_LUA_TOUCH)
            self._delete_script = self._client.register_script(_LUA_DELETE)
            p = config.key_prefix
            self._meta_keys = [f"{p}@lru", f"{p}@sizes", f"{p}@bytes", f"{p}@seq"]

    @classmethod
    def from_config(cls, config: Any) -> RedisTier:
        """Registry factory (``tiers.redis:RedisTier.from_config``): accepts this module's config
        or any config object (``cachestore.tier_config.RedisTierConfig``) with a subset of its
        fields; absent fields take this module's defaults."""
        if not isinstance(config, RedisTierConfig):
            names = [f.name for f in fields(RedisTierConfig)]
            config = RedisTierConfig(**{n: getattr(config, n) for n in names if hasattr(config, n)})
        return cls(config)

    def __repr__(self) -> str:
        return (f"RedisTier(url={redact_url(self.config.url)!r}, cluster={self._cluster}, "
                f"capacity={self.capacity})")  # fmt: skip

    def _k(self, key: str) -> str:
        return self.config.key_prefix + key

    @contextmanager
    def _guard(self, op: str) -> Iterator[None]:
        if self._closed:
            raise TierError(f"redis tier {op} after close")
        try:
            yield
        except self._errors as exc:
            raise TierError(f"redis {op} on {redact_url(self.config.url)}: {exc}") from exc

    def _pipelined(self, op: str, keys: Sequence[str], add: Callable[[Any, str], object]) -> list:
        if not keys:
            return []
        with self._guard(op):
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                add(pipe, self._k(key))
            return list(pipe.execute())

    def _script(self, op: str, script: Any, args: Sequence[Any]) -> Any:
        with self._guard(op):
            return script(keys=self._meta_keys, args=args)

    def lookup(self, keys: Sequence[str]) -> int:
        """Leading keys present; EXISTS pipelined in batches, stopping at the batch of a miss.
        With ``capacity``: one script that also refreshes the recency of the keys it counts."""
        if self.capacity is not None:
            if not keys:
                return 0
            return int(self._script("lookup", self._touch_script,
                                    ["lookup", self.config.key_prefix, *keys]))
        found = 0
        for start in range(0, len(keys), _LOOKUP_BATCH):
            batch = keys[start : start + _LOOKUP_BATCH]
            for exists in self._pipelined("lookup", batch, lambda p, k: p.exists(k)):
                if not exists:
                    return found
                found += 1
        return found

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        """One pipelined GET per key, a single round trip (per node on a cluster). With
        ``capacity`` the same round trip runs a script that refreshes the hits' recency."""
        if self.capacity is not None and keys:
            with self._guard("get"):
                pipe = self._client.pipeline(transaction=False)
                for key in keys:
                    pipe.get(self._k(key))
                self._touch_script(keys=self._meta_keys, client=pipe,
                                   args=["touch", self.config.key_prefix, *keys])
                return list(pipe.execute()[:-1])
        return self._pipelined("get", keys, lambda p, k: p.get(k))

    def put_many(self, items: Sequence[tuple[str, Value]]) -> list[Evicted]:
        """SET each value (with ``EX``/``PX`` when ``ttl_s``); oversize ones are skipped.

        Without ``capacity`` nothing is evicted here (the server evicts silently). With it, the
        least recently used keys are evicted before each value is stored (a value of this very
        call included, if the call alone exceeds the capacity) and returned, oldest first, with
        their bytes. A key given twice keeps its last value. Raises TierError; a failed call may
        have stored (and evicted) part of it.
        """
        kept = [(k, v) for k, v in items if _nbytes(v) <= self.max_value_bytes]
        self.num_oversize_skipped += len(items) - len(kept)
        if not kept:
            return []
        ttl_ms = None if self.config.ttl_s is None else max(1, round(self.config.ttl_s * 1000))
        if self.capacity is not None:
            return self._put_bounded(kept, ttl_ms)
        with self._guard("put"):
            pipe = self._client.pipeline(transaction=False)
            for key, value in kept:
                pipe.set(self._k(key), value, px=ttl_ms)
            pipe.execute()
        return []  # Redis evicts on its own (maxmemory-policy); it does not tell us what

    def _put_bounded(self, items: list[tuple[str, Value]], ttl_ms: int | None) -> list[Evicted]:
        """One MULTI per chunk: the admit script (bookkeeping, evictions), then the SETs."""
        last = {key: idx for idx, (key, _) in enumerate(items)}
        unique = [it for idx, it in enumerate(items) if last[it[0]] == idx]  # last value wins
        # Items that this very call's later items would evict at once (the call alone exceeds
        # the capacity) are not sent: deleted, and reported evicted with their new bytes.
        room, keep_from = self.capacity or 0, len(unique)
        while keep_from > 0 and _nbytes(unique[keep_from - 1][1]) <= room:
            keep_from -= 1
            room -= _nbytes(unique[keep_from][1])
        dropped, admitted = unique[:keep_from], unique[keep_from:]
        evicted: list[Evicted] = []
        for start in range(0, max(len(admitted), 1), _PUT_CHUNK):
            chunk = admitted[start : start + _PUT_CHUNK]
            drop = [k for k, _ in dropped] if start == 0 else []
            args: list[Any] = [self.capacity, self.config.key_prefix, len(drop), *drop]
            for key, value in chunk:
                args += [key, _nbytes(value)]
            with self._guard("put"):
                pipe = self._client.pipeline(transaction=True)
                self._admit_script(keys=self._meta_keys, args=args, client=pipe)
                for key, value in chunk:
                    pipe.set(self._k(key), value, px=ttl_ms)
                flat = pipe.execute()[0]
            evicted += [Evicted(flat[j].decode(), flat[j + 1]) for j in range(0, len(flat), 2)]
        return evicted + [Evicted(k, v) for k, v in dropped]

    def delete_many(self, keys: Sequence[str]) -> int:
        if self.capacity is not None:
            if not keys:
                return 0
            return int(self._script("delete", self._delete_script,
                                    [self.config.key_prefix, *keys]))
        return sum(self._pipelined("delete", keys, lambda p, k: p.delete(k)))

    def usage(self) -> TierUsage:
        """``used_memory`` and ``maxmemory`` (None when 0 = unlimited), summed over primaries;
        with ``capacity``: the tracked value bytes, the capacity and the tracked key count."""
        with self._guard("usage"):
            if self.capacity is not None:
                lru, _, total, _ = self._meta_keys
                pipe = self._client.pipeline(transaction=True)
                raw_total, num_entries = pipe.get(total).zcard(lru).execute()
                return TierUsage(int(raw_total or 0), self.capacity, int(num_entries))
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
        try:
            self._client.close()
        except self._errors:
            pass  # closing a connection to a dead server has nothing left to release


def _nbytes(value: Value) -> int:
    return value.nbytes if isinstance(value, memoryview) else len(value)
