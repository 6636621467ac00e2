"""The hierarchical store's tiers, each behind its own counters and failure backoff.

``GuardedTiers`` pairs tier i with its ``TierStats`` (named after the tier, with the index
appended when two tiers share a name) and its ``TierHealth``. ``call(i, fn, default)`` is how the
store and its parts (``cachestore.store.pins``, ``cachestore.store.host``) reach a tier: skipped while
the tier backs off, any exception logged, counted and answered with ``default``
(``cachestore.store.metrics.call_with_backoff``), so a tier failure is a miss, never an exception.

Thread-safe: the lists are fixed at construction and stats and health lock themselves.
Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from cachestore.store.metrics import TierHealth, TierStats, call_with_backoff
from cachestore.store.types import StoreConfig
from tiers.base import Tier

T = TypeVar("T")


class GuardedTiers:
    __slots__ = ("health", "stats", "tiers")

    def __init__(
        self,
        tiers: Sequence[Tier],
        config: StoreConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """One ``TierStats`` and one ``TierHealth`` per tier, from ``config``'s EWMA and
        backoff settings. Raises ValueError for no tiers."""
        if not tiers:
            raise ValueError("a hierarchical store needs at least one tier")
        self.tiers = list(tiers)
        names = [t.name for t in self.tiers]
        self.stats = [
            TierStats(n if names.count(n) == 1 else f"{n}{i}", config.ewma_alpha)
            for i, n in enumerate(names)
        ]
        self.health = [
            TierHealth(config.backoff_initial_s, config.backoff_max_s, clock) for _ in self.tiers
        ]

    def __len__(self) -> int:
        return len(self.tiers)

    def probe_idle(self, idle_s: float) -> list[int]:
        """``ping`` every tier no call reached for ``idle_s`` seconds and not backing off (a
        backing-off tier gets its probe from the first call after the backoff, as before), so
        its health follows the backend while nothing uses it. A failure counts as any call's
        does. Returns the indices probed. Never raises."""
        probed = [i for i, h in enumerate(self.health) if h.available() and h.idle_s() >= idle_s]
        for i in probed:
            self.call(i, lambda tier: tier.ping(), None)
        return probed

    def call(self, i: int, fn: Callable[[Tier], T], default: T) -> T:
        """``fn(tier i)`` unless it is backing off; a failure counts, backs off and answers
        ``default``. Never raises."""
        return call_with_backoff(
            self.tiers[i],
            fn,
            default,
            name=self.tiers[i].name,
            stats=self.stats[i],
            health=self.health[i],
        )
