"""The hierarchical store's tier writes: one write to one tier, and the demotion workers' writes.

- ``write(i, items)``: a put to tier i in the caller's thread, its bytes and time counted, what
  the tier evicted queued for the tier below (``demote``). The store's ``put_many``, the host
  fast path, the write-through lanes and promotions all write through it.
- ``write_back(i, items)``: a demotion worker's write into tier i (promotions into tier 0 are
  plain writes): keys the tier already holds are not rewritten (one ``contains_many`` per batch,
  counted ``write_present``), the rest counted ``written_back``; a tier the placement skips
  (``skipped``, ``HierarchicalStore.skip_tiers``) passes the batch on down, counted
  ``placement_skipped``.

Both answer -1 when the tier failed or was backing off (nothing written, nothing demoted).
``flush_on_shutdown`` is the store's graceful shutdown of its writes (``shutdown_writes``).
Thread-safe as far as the tiers are (``GuardedTiers.call``). Torch-free.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from cachestore.store.guarded_tiers import GuardedTiers
from cachestore.store.types import SlabTier
from cachestore.store.write_through import DrainReport, WriteThrough
from tiers.base import Evicted, Value

log = logging.getLogger("cachestore.store.hierarchical")  # the store's shutdown line
_SKIP: Any = object()  # a tier call that did not happen or failed


class TierWrites:
    def __init__(self, tiers: GuardedTiers, demote: Callable[[int, list[Evicted]], None]) -> None:
        """``demote(i, evicted)``: queue what tier i evicted for the tier below."""
        self._tiers = tiers
        self._demote = demote
        self.skipped: frozenset[int] = frozenset()  # tiers demotion passes over

    def write(self, i: int, items: Sequence[tuple[str, Value]]) -> int:
        """Write to tier i (in the caller's thread); demote what it evicted. Returns count, or
        -1 when the tier failed or was backing off (nothing written, nothing demoted)."""
        t0 = time.perf_counter()
        evicted = self._tiers.call(i, lambda t: t.put_many(items), _SKIP)
        if evicted is _SKIP:
            return -1
        stats = self._tiers.stats[i]
        stats.record_write(sum(len(v) for _, v in items), time.perf_counter() - t0)
        if evicted:
            stats.add("evictions", len(evicted))
            self._demote(i, evicted)
        return len(items)

    def write_back(self, i: int, items: Sequence[tuple[str, Value]]) -> int:
        """A demotion worker's write (promotions for tier 0): keys tier i already holds are not
        rewritten (``write_present``); the rest are counted ``written_back``. -1 when the tier
        failed or backs off (the movers pass the batch further down)."""
        if i == 0:
            return self.write(0, items)
        stats = self._tiers.stats[i]
        if i in self.skipped:  # never worth loading from: pass the batch on down, counted
            stats.add("placement_skipped", len(items))
            return -1
        keys = [k for k, _ in items]
        flags = self._tiers.call(i, lambda t: t.contains_many(keys), None)
        if flags is None:
            return -1
        todo = [item for item, present in zip(items, flags, strict=True) if not present]
        if len(todo) < len(items):
            stats.add("write_present", len(items) - len(todo))
        if not todo:
            return 0
        written = self.write(i, todo)
        if written > 0:
            stats.add("written_back", written)
        return written


def flush_on_shutdown(
    tiers: GuardedTiers,
    through: WriteThrough,
    flush_movers: Callable[[], None],
    drain_timeout_s: float,
) -> DrainReport:
    """``HierarchicalStore.shutdown_writes``: drain the write-through lanes for up to
    ``drain_timeout_s`` and stop them; copy the host tier's blocks (most recent first) that the
    first healthy tier below it lacks, until another ``drain_timeout_s`` ran out; wait for the
    demotions that caused (``flush_movers``). Logs and returns what it did."""
    t0 = time.monotonic()
    drained, dropped = through.drain(drain_timeout_s)
    top = tiers.tiers[0]
    lru_keys = getattr(top, "lru_keys", None)  # the host tier's committed keys
    target = next((i for i in range(1, len(tiers.tiers)) if tiers.health[i].available()), None)
    flush_tier, flushed, present, left = None, 0, 0, 0
    if isinstance(top, SlabTier) and callable(lru_keys) and target is not None:
        flush_tier = tiers.stats[target].name
        keys: list[str] = list(reversed(tiers.call(0, lambda t: lru_keys(), [])))  # newest first
        flushed, present, left = through.flush_down(
            target, keys, time.monotonic() + drain_timeout_s
        )
    flush_movers()
    report = DrainReport(
        drained, dropped, flush_tier, flushed, present, left, time.monotonic() - t0
    )
    # Losing blocks is worth a warning (visible without logging set up, as in the engine
    # core process); a complete drain is routine.
    level = logging.WARNING if report.dropped or report.flush_left else logging.INFO
    log.log(level, "kv store shutdown: %s", report.describe())
    return report
