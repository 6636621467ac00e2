"""The hierarchical store's write policies: copies of saved blocks to the tiers below the top.

Each tier below the top whose ``WritePolicy`` is a write-through one gets a lane: a bounded
queue of keys (not bytes: the bytes stay in the top tier) and one daemon thread. ``saved(keys)``
queues blocks just saved to the top tier on every ``write_through`` lane; ``hit(keys)`` counts
reads and queues a block on a ``write_through_selective`` lane at its ``hits``-th hit.
Enqueueing never blocks: keys past a lane's ``queue_blocks`` are not copied (counted
``write_queue_dropped``, logged once per lane), so a step or a save never waits on a slow tier.

A lane's thread takes up to ``BATCH_BLOCKS`` keys at a time and:
1. asks its tier which it already holds (``Tier.contains_many``, one call per batch): those are
   not rewritten (``write_present``);
2. reads the rest from the tiers above it: the top tier pinned for the duration (its values may
   be views into the host slab), then, for blocks the top evicted meanwhile, the tiers between
   (checksummed, ``read_lower``);
3. writes them with the store's ``write(i, items)`` (bytes counted, that tier's evictions
   demoted), counted ``written_through``. A tier that fails or backs off loses the batch (its
   ``errors``/``skipped`` count it); the write-back path may still carry the blocks down.

A block is visible in a lower tier only once that tier's put of the whole encoded block (codec
header and checksum included) completed: an LMDB transaction, a Redis SET, an S3 object written
before its pointers, a cache-server put acknowledged after it validated the block.

Shutdown: ``drain(timeout_s)`` waits until the lanes are empty or the time is up, then stops
them (what is still queued is counted ``write_queue_dropped``); ``copy_down(i, keys, ...)`` is
the same copy in the caller's thread, for the store's flush of host-only blocks.

Thread-safe: any thread may call ``saved``/``hit``; one condition guards each lane. Torch-free.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cachestore.launch_gate import STEP_LAUNCHES
from cachestore.store.guarded_tiers import GuardedTiers
from cachestore.store.types import PinningTier, WritePolicy
from tiers.base import Value
from tiers.config import WRITE_THROUGH

log = logging.getLogger("cachestore.store")

BATCH_BLOCKS = 64  # keys a lane copies per tier call: one exists check, one read, one put
_MAX_TRACKED_HITS = 1 << 16  # selective lanes: keys whose hits are counted, oldest forgotten

ReadFn = Callable[[Sequence[str]], list[Value | None]]
WriteFn = Callable[[int, Sequence[tuple[str, Value]]], int]  # count, -1 on failure


@dataclass(slots=True)
class _Lane:
    tier: int
    policy: WritePolicy
    keys: deque[str] = field(default_factory=deque)
    cond: threading.Condition = field(default_factory=threading.Condition)
    busy: bool = False  # a batch taken off the queue is being copied
    warned: bool = False  # the one "queue full" warning was logged
    thread: threading.Thread | None = None


@dataclass(frozen=True, slots=True)
class CopyResult:
    written: int  # blocks written to the tier
    present: int  # blocks it already held (not rewritten)
    missing: int  # blocks no tier above held any more (or whose read failed)
    failed: int  # blocks lost to a failed or backing-off tier


@dataclass(frozen=True, slots=True)
class DrainReport:
    """What ``shutdown_writes`` did: blocks the write-through queues wrote while draining and
    dropped when the time ran out; host-only blocks flushed to ``flush_tier`` (``None``: no
    host tier or no tier below it), found there already, and left unwritten at the deadline."""

    drained: int
    dropped: int
    flush_tier: str | None
    flushed: int
    flush_present: int
    flush_left: int
    seconds: float

    def describe(self) -> str:
        where = f" to {self.flush_tier}" if self.flush_tier else ""
        return (
            f"write-through queues: {self.drained} blocks written, {self.dropped} dropped; "
            f"host-only blocks flushed{where}: {self.flushed} written, "
            f"{self.flush_present} already there, {self.flush_left} left "
            f"({self.seconds:.2f}s)"
        )


class WriteThrough:
    def __init__(
        self,
        tiers: GuardedTiers,
        policies: Sequence[WritePolicy],
        write: WriteFn,
        read_lower: ReadFn,
    ) -> None:
        """One lane (and thread) per tier below the top whose policy copies down.
        ``write(i, items)``: the store's write to tier i; ``read_lower(keys)``: checksummed,
        encoded reads from the tiers below the top, no promotion."""
        self._tiers = tiers
        self._write = write
        self._read_lower = read_lower
        self._lanes = [
            _Lane(i, p) for i, p in enumerate(policies) if 0 < i < len(tiers) and p.copies_down
        ]
        self._hits: OrderedDict[str, int] = OrderedDict()
        self._hits_lock = threading.Lock()
        self._selective = [lane for lane in self._lanes if lane.policy.policy != WRITE_THROUGH]
        self._stopping = False
        self.skipped: frozenset[int] = frozenset()  # tiers not written to (store.skip_tiers)
        for lane in self._lanes:
            lane.thread = threading.Thread(
                target=self._work,
                args=(lane,),
                daemon=True,
                name=f"kvtier-write-{tiers.stats[lane.tier].name}",
            )
            lane.thread.start()

    @property
    def active(self) -> bool:
        """Whether any tier has a write-through lane."""
        return bool(self._lanes)

    def saved(self, keys: Sequence[str]) -> None:
        """Queue ``keys`` (just saved to the top tier) on every ``write_through`` lane. Never
        blocks."""
        if keys:
            for lane in self._lanes:
                if lane.policy.policy == WRITE_THROUGH:
                    self._enqueue(lane, keys)

    def hit(self, keys: Sequence[str]) -> None:
        """Count one hit for each of ``keys``; queue each on the selective lanes whose ``hits``
        it reached now. Never blocks."""
        if not self._selective or not keys:
            return
        reached: dict[int, list[str]] = {}
        with self._hits_lock:
            for key in keys:
                n = self._hits.pop(key, 0) + 1
                self._hits[key] = n
                for lane in self._selective:
                    if n == lane.policy.hits:
                        reached.setdefault(lane.tier, []).append(key)
            while len(self._hits) > _MAX_TRACKED_HITS:
                self._hits.popitem(last=False)
        for lane in self._selective:
            if lane.tier in reached:
                self._enqueue(lane, reached[lane.tier])

    def queued_blocks(self, i: int) -> int:
        """Keys waiting on tier i's lane (0 without one)."""
        for lane in self._lanes:
            if lane.tier == i:
                with lane.cond:
                    return len(lane.keys)
        return 0

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until every lane's queue is empty and no batch is being copied; False when
        ``timeout_s`` ran out first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for lane in self._lanes:
            with lane.cond:
                while lane.keys or lane.busy:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    lane.cond.wait(left)
        return True

    def drain(self, timeout_s: float) -> tuple[int, int]:
        """Wait up to ``timeout_s`` for the lanes to empty, then stop them; returns (blocks
        written through during the drain, blocks dropped because the time ran out). Call once;
        ``saved``/``hit`` afterwards queue nothing."""
        before = self._written()
        self.wait_idle(timeout_s)
        dropped = 0
        for lane in self._lanes:
            with lane.cond:
                left = len(lane.keys)
                lane.keys.clear()
            if left:
                self._tiers.stats[lane.tier].add("write_queue_dropped", left)
            dropped += left
        self.stop()
        return self._written() - before, dropped

    def stop(self) -> None:
        """Stop the lanes' threads (a batch being copied finishes first, up to a few seconds;
        queued keys are forgotten). Idempotent."""
        self._stopping = True
        for lane in self._lanes:
            with lane.cond:
                lane.keys.clear()
                lane.cond.notify_all()
        for lane in self._lanes:
            if lane.thread is not None:
                lane.thread.join(5.0)  # a daemon thread stuck in a dead tier is left behind

    def copy_down(self, i: int, keys: Sequence[str], counter: str) -> CopyResult:
        """Copy ``keys`` (those tier i lacks) from the tiers above it to tier i, in the caller's
        thread; ``counter`` names tier i's counter of the blocks written. Never raises."""
        keys = list(dict.fromkeys(keys))
        if not keys:
            return CopyResult(0, 0, 0, 0)
        stats = self._tiers.stats[i]
        flags = self._tiers.call(i, lambda t: t.contains_many(keys), None)
        if flags is None:  # the tier failed (counted in its errors) or backs off
            return CopyResult(0, 0, 0, len(keys))
        todo = [k for k, present in zip(keys, flags, strict=True) if not present]
        present = len(keys) - len(todo)
        if present:
            stats.add("write_present", present)
        if not todo:
            return CopyResult(0, present, 0, 0)
        top = self._tiers.tiers[0]
        pinned: list[str] = []
        if isinstance(top, PinningTier):
            got = self._tiers.call(0, lambda t: top.pin_each(todo), None)
            pinned = [k for k, ok in zip(todo, got or [False] * len(todo), strict=True) if ok]
        try:
            values = self._tiers.call(0, lambda t: t.get_many(pinned), None) if pinned else []
            items = [(k, v) for k, v in zip(pinned, values or [], strict=False) if v is not None]
            have = {k for k, _ in items}
            rest = [k for k in todo if k not in have]
            if rest and i > 1:  # evicted from the top meanwhile: read from the tiers between
                lower = self._read_lower(rest)
                items += [(k, v) for k, v in zip(rest, lower, strict=True) if v is not None]
            missing = len(todo) - len(items)
            if not items:
                return CopyResult(0, present, missing, 0)
            if self._write(i, items) < 0:
                return CopyResult(0, present, missing, len(items))
            stats.add(counter, len(items))
            return CopyResult(len(items), present, missing, 0)
        finally:
            if pinned:
                self._tiers.call(0, lambda t: top.unpin(pinned), None)  # type: ignore[attr-defined]

    def flush_down(self, i: int, keys: Sequence[str], deadline: float) -> tuple[int, int, int]:
        """``copy_down`` of ``keys`` to tier i in batches, counted ``written_back``, until
        ``time.monotonic()`` passes ``deadline``; returns (written, already there, left
        unwritten: past the deadline or lost to a failing tier)."""
        written = present = left = 0
        for start in range(0, len(keys), BATCH_BLOCKS):
            if time.monotonic() >= deadline:
                return written, present, left + len(keys) - start
            r = self.copy_down(i, keys[start : start + BATCH_BLOCKS], "written_back")
            written, present, left = written + r.written, present + r.present, left + r.failed
        return written, present, left

    # -- internals -----------------------------------------------------------------------

    def _written(self) -> int:
        return sum(
            self._tiers.stats[lane.tier].snapshot()["written_through"] for lane in self._lanes
        )

    def _enqueue(self, lane: _Lane, keys: Sequence[str]) -> None:
        if self._stopping:
            return
        if lane.tier in self.skipped:  # never worth loading from: not copied, counted
            self._tiers.stats[lane.tier].add("placement_skipped", len(keys))
            return
        with lane.cond:
            room = lane.policy.queue_blocks - len(lane.keys)
            lane.keys.extend(keys[: max(room, 0)])
            dropped = len(keys) - max(room, 0)
            lane.cond.notify()
            warn = dropped > 0 and not lane.warned
            lane.warned = lane.warned or warn
        if dropped > 0:
            self._tiers.stats[lane.tier].add("write_queue_dropped", dropped)
        if warn:
            log.warning(
                "tier %s: write-through queue full (%d blocks); blocks past it are not "
                "copied (counted in write_queue_dropped; logged once)",
                self._tiers.stats[lane.tier].name,
                lane.policy.queue_blocks,
            )

    def _work(self, lane: _Lane) -> None:
        while True:
            with lane.cond:
                while not lane.keys and not self._stopping:
                    lane.cond.wait()
                if self._stopping:
                    return
                batch = [lane.keys.popleft() for _ in range(min(BATCH_BLOCKS, len(lane.keys)))]
                lane.busy = True
            try:
                STEP_LAUNCHES.wait_turn()  # not while the engine launches a step
                self.copy_down(lane.tier, batch, "written_through")
            except Exception:  # a lane must survive anything; the batch is lost, counted
                log.exception("write-through to tier %d", lane.tier)
                self._tiers.stats[lane.tier].add("errors")
            finally:
                with lane.cond:
                    lane.busy = False
                    lane.cond.notify_all()
