"""The Redis tier's capacity mode: LRU bookkeeping kept IN Redis, next to the blocks.

Used by ``tiers.redis.RedisTier`` when ``capacity`` is set (see its module docstring for the
semantics). Every client sharing the server sees one order: a sorted set ``{prefix}@lru`` (key ->
access sequence from the counter ``{prefix}@seq``), a hash ``{prefix}@sizes`` (key -> value
bytes) and a running total ``{prefix}@bytes``. A write is one MULTI: the admit script (updates
the bookkeeping and evicts), then the SETs; reads (which refresh recency) and deletes run small
scripts. Each is atomic on the server, so concurrent clients never overshoot the capacity or
report one eviction twice. Values never pass through Lua (a copy into and out of a Lua string
halves throughput).

Thread-safe (redis-py clients are; pipelines are per call). Raises only what ``guard`` raises.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from tiers.base import Evicted, TierUsage, Value
from tiers.shared import last_value_wins, nbytes

Guard = Callable[[str], AbstractContextManager[None]]

# KEYS of every script: @lru zset, @sizes hash, @bytes total, @seq counter. Block keys are passed
# in ARGV, without the prefix, so the bookkeeping stores them bare.
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
_LUA_ADMIT = (
    _LUA_FORGET
    + """
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
)
# ARGV: mode ('touch' | 'lookup'), prefix, keys... A present key gets a fresh recency (tracked
# keys only); an absent one is forgotten. 'lookup' stops at the first absent key and returns
# how many came before it; 'touch' (after a pipelined GET) visits every key.
_LUA_TOUCH = (
    _LUA_FORGET
    + """
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
)
# ARGV: prefix, keys... Returns how many keys existed.
_LUA_DELETE = (
    _LUA_FORGET
    + """
local n = 0
for i = 2, #ARGV do
  n = n + redis.call('DEL', ARGV[1] .. ARGV[i])
  forget(ARGV[i])
end
return n
"""
)
_PUT_CHUNK = 32  # items per put script: bounds one script's run time and argument size


class RedisLru:
    """Capacity-bounded LRU operations over one (non-cluster) Redis client.

    ``guard(op)`` wraps every server call (the tier's TierError conversion and closed check).
    """

    def __init__(self, client: Any, key_prefix: str, capacity: int, guard: Guard) -> None:
        self.capacity = capacity
        self._client = client
        self._prefix = key_prefix
        self._guard = guard
        # register_script loads nothing yet: EVALSHA, falling back to EVAL after a restart.
        self._admit = client.register_script(_LUA_ADMIT)
        self._touch = client.register_script(_LUA_TOUCH)
        self._delete = client.register_script(_LUA_DELETE)
        p = key_prefix
        self._meta_keys = [f"{p}@lru", f"{p}@sizes", f"{p}@bytes", f"{p}@seq"]

    def lookup(self, keys: Sequence[str]) -> int:
        """Leading keys present, in one script that also refreshes their recency."""
        if not keys:
            return 0
        with self._guard("lookup"):
            return int(self._touch(keys=self._meta_keys, args=["lookup", self._prefix, *keys]))

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        """Pipelined GETs and, in the same round trip, the script refreshing the hits."""
        if not keys:
            return []
        with self._guard("get"):
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.get(self._prefix + key)
            self._touch(keys=self._meta_keys, client=pipe, args=["touch", self._prefix, *keys])
            return list(pipe.execute()[:-1])

    def put_many(self, items: Sequence[tuple[str, Value]], ttl_ms: int | None) -> list[Evicted]:
        """One MULTI per chunk: the admit script (bookkeeping, evictions), then the SETs.
        Returns the evicted keys, oldest first, with their bytes; ``items`` must each fit."""
        unique = last_value_wins(items)
        # Items that this very call's later items would evict at once (the call alone exceeds
        # the capacity) are not sent: deleted, and reported evicted with their new bytes.
        room, keep_from = self.capacity, len(unique)
        while keep_from > 0 and nbytes(unique[keep_from - 1][1]) <= room:
            keep_from -= 1
            room -= nbytes(unique[keep_from][1])
        dropped, admitted = unique[:keep_from], unique[keep_from:]
        evicted: list[Evicted] = []
        for start in range(0, max(len(admitted), 1), _PUT_CHUNK):
            chunk = admitted[start : start + _PUT_CHUNK]
            drop = [k for k, _ in dropped] if start == 0 else []
            args: list[Any] = [self.capacity, self._prefix, len(drop), *drop]
            for key, value in chunk:
                args += [key, nbytes(value)]
            with self._guard("put"):
                pipe = self._client.pipeline(transaction=True)
                self._admit(keys=self._meta_keys, args=args, client=pipe)
                for key, value in chunk:
                    pipe.set(self._prefix + key, value, px=ttl_ms)
                flat = pipe.execute()[0]
            evicted += [Evicted(flat[j].decode(), flat[j + 1]) for j in range(0, len(flat), 2)]
        return evicted + [Evicted(k, v) for k, v in dropped]

    def delete_many(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        with self._guard("delete"):
            return int(self._delete(keys=self._meta_keys, args=[self._prefix, *keys]))

    def usage(self) -> TierUsage:
        """The tracked value bytes, the capacity and the tracked key count."""
        lru, _, total, _ = self._meta_keys
        with self._guard("usage"):
            pipe = self._client.pipeline(transaction=True)
            raw_total, num_entries = pipe.get(total).zcard(lru).execute()
        return TierUsage(int(raw_total or 0), self.capacity, int(num_entries))
