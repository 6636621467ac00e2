"""Redis tier: encoded blocks as plain Redis strings, one key per block, batched by pipelines.

Two ways to bound it:

- ``capacity=None`` (default): the server owns capacity (``maxmemory`` and its eviction policy),
  so ``put_many`` never reports evictions and ``usage`` is what ``INFO memory`` and ``DBSIZE``
  say (best effort: they count every key of the database, not only kvtier's).
- ``capacity=N`` bytes of values: the tier keeps LRU bookkeeping IN Redis, next to the blocks,
  so that every client sharing the server sees one order: a sorted set ``{prefix}@lru`` (key ->
  access sequence from the counter ``{prefix}@seq``), a hash ``{prefix}@sizes`` (key -> value
  bytes) and a running total ``{prefix}@bytes``. Writes, reads (which refresh recency) and
  deletes run as Lua scripts, each atomic on the server, so concurrent clients never overshoot
  the capacity or report one eviction twice. ``put_many`` evicts the least recently used keys
  before storing each value and returns them as ``Evicted`` with their bytes (GET, then DEL, in
  the same script), so the store demotes them to the next tier (S3). Keys gone behind the
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
# Block keys are passed in ARGV, without the prefix, so the bookkeeping stores them bare.
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
# ARGV: capacity, ttl_ms (0: none), prefix, key1, value1, key2, value2, ...
# Returns victim1, value1, victim2, value2, ... (victims whose value was already gone omitted).
_LUA_PUT = """
local cap, ttl, pre = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
local out = {}
for i = 4, #ARGV, 2 do
  local key, value = ARGV[i], ARGV[i + 1]
  local old = redis.call('HGET', KEYS[2], key)
  if old then  -- an overwrite: its old bytes leave first, and it is never its own victim
    total = total - tonumber(old)
    redis.call('ZREM', KEYS[1], key)
  end
  while total + #value > cap do
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
  if ttl > 0 then
    redis.call('SET', pre .. key, value, 'PX', ttl)
  else
    redis.call('SET', pre .. key, value)
  end
  redis.call('HSET', KEYS[2], key, #value)
  redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[4]), key)
  total = total + #value
end
redis.call('SET', KEYS[3], total)
return out
"""
# ARGV: mode ('get' | 'lookup'), prefix, keys... A hit refreshes recency (tracked keys only);
# a miss forgets the key. 'get' returns values (nil = miss); 'lookup' the leading hit count.
_LUA_READ = _LUA_FORGET + """
local mode, pre = ARGV[1], ARGV[2]
local out = {}
for i = 3, #ARGV do
  local key = ARGV[i]
  local value
  if mode == 'get' then
    value = redis.call('GET', pre .. key)
  else
    value = redis.call('EXISTS', pre .. key) == 1
  end
  if value then
    if redis.call('ZSCORE', KEYS[1], key) then
      redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[4]), key)
    end
  else
    forget(key)
    if mode == 'lookup' then return i - 3 end
  end
  out[i - 2] = value
end
if mode == 'lookup' then return #ARGV - 2 end
return out
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
            self._put_script = self._client.register_script(_LUA_PUT)
            self._read_script = self._client.register_script(_LUA_READ)
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
            return int(self._script("lookup", self._read_script,
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
        ``capacity``: one script that also refreshes the recency of every hit."""
        if self.capacity is not None:
            if not keys:
                return []
            return list(self._script("get", self._read_script,
                                     ["get", self.config.key_prefix, *keys]))
        return self._pipelined("get", keys, lambda p, k: p.get(k))

    def put_many(self, items: Sequence[tuple[str, Value]]) -> list[Evicted]:
        """SET each value (with ``EX``/``PX`` when ``ttl_s``); oversize ones are skipped.

        Without ``capacity`` nothing is evicted here (the server evicts silently). With it, the
        least recently used keys are evicted before each value is stored (a value of this very
        call included, if the call alone exceeds the capacity) and returned, oldest first, with
        their bytes. Raises TierError; a failed call may have stored (and evicted) part of it.
        """
        kept = [(k, v) for k, v in items if _nbytes(v) <= self.max_value_bytes]
        self.num_oversize_skipped += len(items) - len(kept)
        if not kept:
            return []
        ttl_ms = None if self.config.ttl_s is None else max(1, round(self.config.ttl_s * 1000))
        if self.capacity is not None:
            evicted: list[Evicted] = []
            for start in range(0, len(kept), _PUT_CHUNK):
                args: list[Any] = [self.capacity, ttl_ms or 0, self.config.key_prefix]
                for key, value in kept[start : start + _PUT_CHUNK]:
                    args += [key, value]
                flat = self._script("put", self._put_script, args)
                evicted += [Evicted(flat[j].decode(), flat[j + 1])
                            for j in range(0, len(flat), 2)]  # fmt: skip
            return evicted
        with self._guard("put"):
            pipe = self._client.pipeline(transaction=False)
            for key, value in kept:
                pipe.set(self._k(key), value, px=ttl_ms)
            pipe.execute()
        return []  # Redis evicts on its own (maxmemory-policy); it does not tell us what

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
