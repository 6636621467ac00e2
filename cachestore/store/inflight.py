"""Blocks on their way down: demoted by a tier, queued for the tier below, not yet written.

A demotion hands the evicted block's bytes to the movers' queue (``cachestore.store.demotion``).
Until the tier below has written it, the block is in neither tier: a lookup or read that asked
only the tiers would miss it and the engine would recompute a prefix whose bytes sit in this
process's memory. On the H200 QA run with a 2 GiB host tier over LMDB, histories saved in the
first seconds were found in no tier 10 s later and recomputed; on the CPU, with a writer
slower than the saves, whole histories were invisible behind the queue
(``tests/cachestore/store/test_inflight.py``).

``InFlight`` holds, per target tier, the queued values by key. The movers ``add`` a batch
before queueing it and ``discard`` it once the tier's write (or its pass further down) is
done; a key re-demoted meanwhile keeps its newer value. Reads treat a block here as held by
its target tier (``HierarchicalStore.lookup``, ``get_many*``), checked by the codec like any
other value. Thread-safe (one lock); values are immutable ``bytes`` or views the queue keeps
alive. Torch-free.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from tiers.base import Value


class InFlight:
    def __init__(self, num_tiers: int) -> None:
        self._by_tier: list[dict[str, Value]] = [{} for _ in range(num_tiers)]
        self._lock = threading.Lock()

    def add(self, tier: int, items: Sequence[tuple[str, Value]]) -> None:
        """``items`` are queued for ``tier``."""
        with self._lock:
            self._by_tier[tier].update(items)

    def discard(self, tier: int, items: Sequence[tuple[str, Value]]) -> None:
        """``items`` left ``tier``'s queue (written, failed or passed down); a key queued again
        since with another value stays."""
        with self._lock:
            held = self._by_tier[tier]
            for key, value in items:
                if held.get(key) is value:
                    del held[key]

    def drop(self, keys: Sequence[str]) -> None:
        """Stop reading ``keys`` from any queue (the store deleted them)."""
        with self._lock:
            for held in self._by_tier:
                for key in keys:
                    held.pop(key, None)

    def get(self, tier: int, key: str) -> Value | None:
        with self._lock:
            return self._by_tier[tier].get(key)

    def leading(self, tier: int, keys: Sequence[str], start: int) -> int:
        """How many of ``keys[start:]`` are queued for ``tier``, from ``start`` on."""
        with self._lock:
            held = self._by_tier[tier]
            n = start
            while n < len(keys) and keys[n] in held:
                n += 1
            return n - start

    def count(self, tier: int) -> int:
        with self._lock:
            return len(self._by_tier[tier])
