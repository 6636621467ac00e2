"""The one protocol every storage tier implements (host, lmdb, redis, s3, remote).

Keys are ``cachestore.hashing.block_key`` strings (``namespace_prefix/hex(chained hash)``).
Values are encoded blocks (``cachestore.codec``): opaque bytes to a tier. A tier never decodes.

Contracts shared by every tier (tests/tiers/ checks them against real servers):

- All operations are batched and ordered like their ``keys`` argument.
- ``lookup`` does not mutate contents; it may refresh recency (LRU) where the tier keeps it.
  ``contains_many`` answers per key (not only the leading ones).
- ``get_many`` returns ``None`` for a key that is absent. It may return ``bytes`` or a
  ``memoryview``; a memoryview stays valid until the next call on the same thread.
- ``get_many_into`` reads values into buffers the caller owns (the host slab, pinned staging),
  one per key, and returns each value's length (``None``: absent). A value longer than its
  buffer is not written (the caller sees the length and treats it as a miss or reads again with
  ``get_many``); bytes of a buffer past the returned length are left untouched. Backends that can
  (LMDB) copy straight from their medium into the buffer; the default goes through ``get_many``.
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
from typing import Any

Value = bytes | memoryview


class TierError(Exception):
    """A backend failure (timeout, connection lost, I/O error). Never a plain miss."""


@dataclass(frozen=True, slots=True)
class Evicted:
    key: str
    value: Value | None  # None where the tier could not hand the bytes over
    # The tier below already held it, so no bytes were copied out (``HostTier.held_below``):
    # nothing to demote, nothing lost.
    held_below: bool = False


@dataclass(frozen=True, slots=True)
class TierUsage:
    used_bytes: int
    capacity_bytes: int | None  # None: unbounded or managed by the server (Redis maxmemory, S3)
    num_entries: int


class Tier(ABC):
    """A key -> encoded-block store. See the module docstring for the shared contracts."""

    name: str = "tier"
    # True where ``get_many``'s memoryviews stay valid for as long as they are held (recycled
    # read buffers, ``tiers.buffers``), so a caller may keep them past its next call (the
    # store queues them for promotion without a copy). False: a view may be valid only until
    # the next call on the same thread (the contract above); ``bytes`` values always are.
    owns_read_values: bool = False

    def holds_hint(self, key: str) -> bool:
        """True when this tier surely holds ``key`` now, answered from memory without I/O or
        a lock (a tier above asks it under its own lock: ``HostTier.held_below``). May be
        stale by a concurrent write; False when unknown (the default: no index in memory)."""
        return False

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

    def get_many_into(self, keys: Sequence[str], out: Sequence[Any]) -> list[int | None]:
        """Read each of ``keys`` into ``out[i]`` (a writable, C-contiguous buffer: bytearray,
        memoryview, numpy array; e.g. slices of one big staging buffer); return the value
        lengths in order, ``None`` where absent. A length above ``len(out[i])`` (in bytes) means
        the value did not fit and nothing was written to ``out[i]``. Same recency effects, errors
        (TierError) and thread safety as ``get_many``. Raises ValueError (one line) when ``out``
        and ``keys`` differ in length or a buffer is read-only. This default copies what
        ``get_many`` returns; a backend that can read into the buffer directly overrides it."""
        views = writable_views(keys, out)
        lengths: list[int | None] = []
        for view, value in zip(views, self.get_many(keys), strict=True):
            lengths.append(copy_into(view, value))
        return lengths

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


def writable_views(keys: Sequence[str], out: Sequence[Any]) -> list[memoryview]:
    """``out`` as flat byte views, checked for ``get_many_into``. Raises ValueError."""
    if len(out) != len(keys):
        raise ValueError(f"get_many_into: {len(keys)} keys but {len(out)} buffers")
    views = []
    for i, buf in enumerate(out):
        try:
            view = memoryview(buf).cast("B")
        except TypeError as exc:
            raise ValueError(
                f"get_many_into: buffer {i} is not C-contiguous bytes ({exc})"
            ) from None
        if view.readonly:
            raise ValueError(f"get_many_into: buffer {i} is read-only")
        views.append(view)
    return views


def copy_into(view: memoryview, value: Value | None) -> int | None:
    """Copy ``value`` into the front of ``view`` when it fits; its length (None when absent)."""
    if value is None:
        return None
    src = memoryview(value).cast("B")
    if src.nbytes <= view.nbytes:
        view[: src.nbytes] = src
    return src.nbytes
