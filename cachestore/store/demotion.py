"""The hierarchical store's background movers: one bounded queue and one worker per tier.

Queue i feeds tier i: promotions (hits from lower tiers) for the top tier, demotions (what tier
i-1 evicted) for the others. Enqueueing never blocks: a full queue drops the batch, counted in
``promotions_dropped`` / ``demotions_dropped``. A worker writes its batch with the store's
``write(i, batch)`` (which demotes that tier's own evictions in turn); a tier backing off, or
whose write failed, passes its demotions on to the tier below. The last tier's evictions are
dropped (``dropped_at_bottom``) and reported to ``on_drop``.

Thread-safe: ``demote``/``promote`` may be called from any thread; the workers are daemon
threads started by the constructor and stopped by ``stop``. Torch-free.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from cachestore.launch_gate import STEP_LAUNCHES
from cachestore.store.inflight import InFlight
from cachestore.store.metrics import TierHealth, TierStats
from tiers.base import Evicted, Value

log = logging.getLogger(__name__)
_STOP: Any = object()

Batch = list[tuple[str, Value]]
WriteFn = Callable[[int, Batch], int]  # count written, or -1 when the tier failed / backed off


class TierMovers:
    def __init__(
        self,
        stats: Sequence[TierStats],
        health: Sequence[TierHealth],
        queue_batches: int,
        write: WriteFn,
        on_drop: Callable[[list[str]], None] | None,
        inflight: InFlight,
    ) -> None:
        """Start one worker per tier (``stats[i].name`` names its thread). ``inflight``: where
        queued demotions stay readable until written (``cachestore.store.inflight``)."""
        self._stats = stats
        self._inflight = inflight
        self._health = health
        self._write = write
        self._on_drop = on_drop
        self._queues: list[queue.Queue[Any]] = [queue.Queue(queue_batches) for _ in stats]
        self._workers = [
            threading.Thread(
                target=self._work, args=(i,), daemon=True, name=f"kvtier-store-{s.name}"
            )
            for i, s in enumerate(stats)
        ]
        for worker in self._workers:
            worker.start()

    def demote(self, i: int, evicted: list[Evicted]) -> None:
        """Queue what tier i evicted for tier i+1 (or drop it at the bottom). Never blocks."""
        stats = self._stats[i]
        if i + 1 == len(self._queues):
            stats.add("dropped_at_bottom", len(evicted))
            if self._on_drop is not None:
                self._on_drop([e.key for e in evicted])
            return
        batch = [(e.key, e.value) for e in evicted if e.value is not None]
        present = sum(e.held_below for e in evicted)
        if present:  # the tier below holds them already: nothing to write
            self._stats[i + 1].add("write_present", present)
        if len(batch) + present < len(evicted):
            stats.add("demotions_dropped", len(evicted) - len(batch) - present)
        if batch:
            stats.add("demoted", len(batch))  # copied out of tier i, queued for the tier below
            self._inflight.add(i + 1, batch)  # readable before it can be taken off the queue
            try:
                self._queues[i + 1].put_nowait(batch)
            except queue.Full:
                stats.add("demotions_dropped", len(batch))
                self._inflight.discard(i + 1, batch)

    def promote(self, items: list[tuple[str, Value]]) -> None:
        """Queue hits from lower tiers for the top tier. Never blocks. The queue holds the
        values until the top tier's put copies them: they must stay valid while held."""
        try:
            self._queues[0].put_nowait(items)
        except queue.Full:
            self._stats[0].add("promotions_dropped", len(items))
            return
        self._stats[0].add("promotions", len(items))

    def queued_batches(self, i: int) -> int:
        return self._queues[i].qsize()

    def flush(self) -> None:
        """Wait until the batches queued so far are written."""
        for q in self._queues:  # items only flow downwards, so one pass in order suffices
            q.join()

    def stop(self) -> None:
        """Drain the queues and join the workers. Call once."""
        self.flush()
        for q in self._queues:
            q.put(_STOP)
        for worker in self._workers:
            worker.join()

    def _work(self, i: int) -> None:
        q = self._queues[i]
        while True:
            batch = q.get()
            try:
                if batch is _STOP:
                    return
                STEP_LAUNCHES.wait_turn()  # not while the engine launches a step
                if i > 0 and not self._health[i].available():
                    # A tier backing off passes its demotions further down instead.
                    self._stats[i].add("skipped")
                    self.demote(i, [Evicted(k, v) for k, v in batch])
                elif self._write(i, batch) < 0 and i > 0:
                    # So does a tier whose write just failed (counted in its errors).
                    self.demote(i, [Evicted(k, v) for k, v in batch])
            except Exception:  # a worker must survive anything; the batch is lost, counted
                log.exception("store worker for tier %d", i)
                self._stats[i].add("errors")
            finally:
                # Written, or passed further down (queued there first): no longer in flight here.
                if i > 0 and batch is not _STOP:  # queue 0 holds promotions
                    self._inflight.discard(i, batch)
                q.task_done()
