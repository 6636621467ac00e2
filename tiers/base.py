"""The one protocol every storage tier implements (host, lmdb, redis, s3, remote).

Keys are ``cachestore.hashing.block_key`` strings (``namespace_prefix/hex(chained hash)``).
Values are encoded blocks (``cachestore.codec``): opaque bytes to a tier. A tier never decodes.

Contracts shared by every tier (tests/tiers/ checks them against real servers):

- All operations are batched and ordered like their ``keys`` argument.
- ``lookup`` does not mutate contents; it may refresh recency (LRU) where the tier keeps it.
  ``contains_many`` answers per key (not only the leading ones).
- ``get_many`` returns ``None`` for a key that is absent. It may return ``bytes`` or a
  ``memoryview``; a memoryview stays valid until the next call on the same thread.
- ``put_many`` stores every pair or skips ones it cannot hold (too large, tier full of pinned
  data); it returns the keys it evicted to make room, with their values when the tier can still
  hand them over (so the store can demote them), in eviction order.
- Failures of the backend (timeout, lost connection) raise ``TierError``; the hierarchical store
  turns them into misses. A tier never raises for a plain miss.
- Thread safety: every tier is safe to call from several threads at once unless its
  docstring says otherwise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

Value = bytes | memoryview


class TierError(Exception):
    """A backend failure (timeout, connection lost, I/O error). Never a plain miss."""


@dataclass(frozen=True, slots=True)
class Evicted:
    key: str
    value: Value | None  # None where the tier could not hand the bytes over


@dataclass(frozen=True, slots=True)
class TierUsage:
    used_bytes: int
    capacity_bytes: int | None  # None: unbounded or managed by the server (Redis maxmemory, S3)
    num_entries: int


class Tier(ABC):
    """A key -> encoded-block store. See the module docstring for the shared contracts."""

    name: str = "tier"

    @abstractmethod
    def lookup(self, keys: Sequence[str]) -> int:
        """Number of leading ``keys`` present. Stops at the first absent key."""

    @abstractmethod
    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        """Values for ``keys``; ``None`` where absent."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[str, Value]]) -> list[Evicted]:
        """Store ``items`` (overwriting equal keys); return what was evicted to make room."""

    @abstractmethod
    def delete_many(self, keys: Sequence[str]) -> int:
        """Delete ``keys``; return how many were present."""

    @abstractmethod
    def usage(self) -> TierUsage:
        """Bytes used, capacity and entry count (best effort for server-managed tiers)."""

    def contains(self, key: str) -> bool:
        return self.lookup([key]) == 1

    def ping(self) -> None:  # noqa: B027 - optional hook
        """One cheap round trip to the backend, touching no key: the store's idle probe
        (``cachestore.store.prober``). Raises TierError when the backend cannot be reached. An
        in-process tier has nothing to reach: this default does nothing."""

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each of ``keys`` is present, past an absent one too: the store's batched
        exists check before a write-through or a demotion (a key a tier holds is not written
        again). This default asks ``lookup`` once per key; backends answer in one round trip.
        Raises TierError on a backend failure."""
        return [self.lookup([key]) == 1 for key in keys]

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections, files and memory. Idempotent."""

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
