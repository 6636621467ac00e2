"""Shared pieces of the store and cache-server tests: keys and blocks of one namespace, a
two-tier store (host over LMDB), per-tier counters, a settable clock, a tier whose backend is
gone, host/LMDB tiers logging their pin calls, and ``sized_block`` (an encoded block of an
exact size, what the daemon accepts).

``DownTier`` also serves any test that needs a tier failing every call (calibration's broken
tier: ``DownTier(name="redis")``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cachestore.codec import BlockMeta, encode_block, encoded_size
from cachestore.hashing import Namespace, block_key, hash_request_tokens
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from tiers.base import Evicted, Tier, TierError, TierUsage, Value
from tiers.host import HostTier
from tiers.lmdb import LmdbTier
from tiers.remote.protocol import checksum

NS = Namespace("store-test")
PREFIX = NS.key_prefix()
META = BlockMeta(dtype="uint8", shape=(32,), layout="block_major_v1", namespace=PREFIX)
SIZE = encoded_size(META)
KEYS = [block_key(NS, h) for h in hash_request_tokens(NS, list(range(16 * 24)))]


def sized_block(key: str, size: int) -> bytes:
    """An encoded block of exactly ``size`` bytes in ``key``'s namespace, its payload derived
    from ``key`` (deterministic: the same key always gives the same bytes)."""
    ns = key.split("/", 1)[0]
    n = size - encoded_size(BlockMeta("uint8", (0,), "test", ns))
    seed = checksum(key.encode()).to_bytes(8, "little")
    return encode_block((seed * (n // 8 + 1))[:n], BlockMeta("uint8", (n,), "test", ns))


def payload(i: int) -> bytes:
    return bytes([i]) * 32


def block(i: int) -> bytes:
    return encode_block(payload(i), META)


class FakeClock:
    """A monotonic clock the test moves by hand (``clock.now += seconds``)."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def make_store(
    tmp_path: Path, host_blocks: int = 4, lmdb_blocks: int = 6, **config: Any
) -> HierarchicalStore:
    tiers = [HostTier(host_blocks * SIZE, SIZE), LmdbTier(tmp_path / "db", lmdb_blocks * SIZE)]
    return HierarchicalStore(tiers, StoreConfig(namespace=PREFIX, **config))


def counters(store: HierarchicalStore, name: str) -> list[int]:
    return [row[name] for row in store.stats()["tiers"]]


class DownTier(Tier):
    """A tier whose backend is gone: every call raises TierError."""

    def __init__(self, name: str = "down") -> None:
        self.name = name

    def lookup(self, keys: Sequence[str]) -> int:
        raise TierError("down")

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        raise TierError("down")

    def put_many(self, items: Sequence[tuple[str, Value]]) -> list[Evicted]:
        raise TierError("down")

    def delete_many(self, keys: Sequence[str]) -> int:
        raise TierError("down")

    def usage(self) -> TierUsage:
        raise TierError("down")


class _PinLog:
    """Records each pin_each/unpin call of a tier as (tier name, op, keys)."""

    calls: list[tuple[str, str, list[str]]]

    def pin_each(self, keys: Sequence[str]) -> list[bool]:
        self.calls.append((self.name, "pin_each", list(keys)))  # type: ignore[attr-defined]
        return super().pin_each(keys)  # type: ignore[misc, no-any-return]

    def unpin(self, keys: Sequence[str]) -> None:
        self.calls.append((self.name, "unpin", list(keys)))  # type: ignore[attr-defined]
        super().unpin(keys)  # type: ignore[misc]


class PinLogHost(_PinLog, HostTier):
    """A host tier that logs its pin calls."""


class PinLogLmdb(_PinLog, LmdbTier):
    """An LMDB tier that logs its pin calls."""
