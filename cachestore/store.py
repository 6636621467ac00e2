"""The hierarchical store: one ordered list of tiers (top = fastest) behind one API.

- ``lookup`` says, per tier, how many leading keys it holds, and for the chain which tier serves
  each leading block (the first tier holding it); the chain is the longest prefix available
  across all tiers.
- ``get_many`` reads top-down, decodes through the codec (checksum, namespace), and queues
  hits from lower tiers for promotion into the top tier (asynchronous).
- ``get_many_encoded`` is the same read but returns the still-encoded blocks (validated first):
  what a cache server hands on to its clients.
- ``put_many`` writes encoded blocks to the top tier and, with ``write_through_to`` set,
  synchronously to that (durable) tier too before returning. Evictions from tier i are demoted
  to tier i+1 in the background, never blocking the caller (``cachestore.demotion``).
- Host fast path (when the top tier is a ``SlabTier``, the host tier): ``locate_host`` gives
  slab offsets of pinned host blocks whose header matches (no checksum: this process wrote
  them), so the caller copies payloads straight out of the slab; ``stage_host`` reads blocks
  from lower tiers (checksummed) into the slab and pins them there; ``reserve_host`` /
  ``commit_host`` / ``abort_host`` let a device copy land in a host slot in place, evictions
  going to the demotion queue as for ``put_many``.
- Pins: between ``prepare_load`` and ``complete_load`` a key is pinned (one call per tier for
  the batch) in every tier that supports pins (``PinningTier``: host, lmdb); not evicted there.
- In-flight stores: ``prepare_store`` hands each key to one caller only (not present at the top,
  not being stored); ``put_many`` skips a key another ``put_many`` is writing. A concurrent
  ``get_many`` of a key being stored MISSES; it never waits.
- Failures: a TierError (or any exception) from a tier is a miss or a skipped write plus an
  ``errors`` count, never an exception to the caller; a CodecError is a miss plus ``corrupt``,
  and the bad value is deleted. A failing tier is skipped with exponential backoff
  (``TierHealth``), then probed again. ``on_drop`` hears of keys dropped at the bottom.

Thread-safe. Torch-free. The store owns its tiers: ``close`` closes them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from cachestore.codec import CodecError, decode_block
from cachestore.demotion import TierMovers
from cachestore.store_metrics import TierHealth, TierStats, call_with_backoff, register_prometheus
from cachestore.store_types import LookupResult, PinningTier, SlabTier, StoreConfig, TierLookup
from tiers.base import Tier, TierUsage, Value

__all__ = ["HierarchicalStore", "LookupResult", "StoreConfig", "TierLookup"]  # old import paths

log = logging.getLogger(__name__)
T = TypeVar("T")
_SKIP: Any = object()  # a tier call that did not happen or failed


class HierarchicalStore:
    def __init__(self, tiers: Sequence[Tier], config: StoreConfig, *, registry: Any = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_drop: Callable[[list[str]], None] | None = None) -> None:
        """Start one worker per tier. ``registry``: a prometheus_client CollectorRegistry.
        ``on_drop(keys)`` is called (from the writing thread) with keys the last tier evicted.
        Raises ValueError for no tiers or a ``write_through_to`` past the last tier."""
        if not tiers:
            raise ValueError("a hierarchical store needs at least one tier")
        if config.write_through_to is not None and config.write_through_to >= len(tiers):
            raise ValueError(f"write_through_to={config.write_through_to} but only "
                             f"{len(tiers)} tier(s)")
        self.tiers = list(tiers)
        self.config = config
        names = [t.name for t in self.tiers]
        self._stats = [TierStats(n if names.count(n) == 1 else f"{n}{i}", config.ewma_alpha)
                       for i, n in enumerate(names)]
        self._health = [TierHealth(config.backoff_initial_s, config.backoff_max_s, clock)
                        for _ in self.tiers]
        self._lock = threading.Lock()
        self._storing: set[str] = set()  # handed out by prepare_store
        self._writing: set[str] = set()  # inside a put_many
        self._load_pins: Counter[tuple[int, str]] = Counter()
        self._movers = TierMovers(self._stats, self._health, config.queue_batches, self._write,
                                  on_drop)
        self._collector = None
        if registry is not None:
            self._collector = register_prometheus(registry, self._tier_rows)
        self._registry = registry
        self._closed = False

    # -- reads ---------------------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> LookupResult:
        """Side-effect free but for LRU refreshes inside tiers. Never raises for tier failures."""
        per_tier = [self._call(i, lambda t: t.lookup(keys), 0) for i in range(len(self.tiers))]
        # known[i] = (start, n): tier i holds keys[start:start+n] and not keys[start+n].
        known = [(0, n) for n in per_tier]
        served: list[int] = []
        for p in range(len(keys)):
            for i in range(len(self.tiers)):
                start, n = known[i]
                if p > start + n:  # past what we know: ask again from p
                    start, n = p, self._call(i, lambda t, p=p: t.lookup(keys[p:]), 0)
                    known[i] = (start, n)
                if p < start + n:
                    served.append(i)
                    break
            else:
                break
        per = tuple(TierLookup(s.name, n) for s, n in zip(self._stats, per_tier, strict=True))
        return LookupResult(per_tier=per, served_by=tuple(served))

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        """Decoded payloads (``None`` = miss), top tier first. Never raises for tier failures.

        A payload from the host tier is a view into its slab: stable while the key is pinned
        (``prepare_load``), otherwise until the host tier evicts it. Others are owned bytes.
        """
        return self._read(keys, decoded=True)

    def get_many_encoded(self, keys: Sequence[str]) -> list[Value | None]:
        """Like ``get_many`` (same checks, promotion, counters, view lifetime) but each hit is
        the whole encoded block, checksum and namespace already verified; a block that fails
        them is a miss and is deleted, exactly as in ``get_many``."""
        return self._read(keys, decoded=False)

    # -- host fast path --------------------------------------------------------------------

    def host_slab(self) -> SlabTier | None:
        """The top tier when it is a slab tier (``locate``/``reserve``/``commit``), else None."""
        top = self.tiers[0]
        return top if isinstance(top, SlabTier) else None

    def locate_host(self, keys: Sequence[str], header: bytes, nbytes: int) -> list[int | None]:
        """Slab offsets of ``keys`` in the host tier (``SlabTier.locate``), each hit pinned
        there (balance with ``unpin_host`` of the hits); all None without a slab tier or when it
        fails. Counts hits like a read. Never raises for tier failures."""
        slab = self.host_slab()
        if slab is None or not keys:
            return [None] * len(keys)
        t0 = time.perf_counter()
        out = self._call(0, lambda t: slab.locate(keys, header, nbytes, pin=True), None)
        if out is None:
            return [None] * len(keys)
        hits = sum(o is not None for o in out)
        self._stats[0].record_read(hits, len(keys) - hits, hits * nbytes, time.perf_counter() - t0)
        return out

    def stage_host(self, keys: Sequence[str]) -> int:
        """Pin ``keys`` in the host tier, reading the ones it lacks from the lower tiers
        (checksummed, no promotion) and writing them there first (evictions demoted) when they
        all fit beside the pinned and reserved entries; return
        how many leading keys are now pinned in the host tier (pins past those are undone).
        Balance with ``unpin_host(keys[:n])``. Never reads host bytes unpinned: a slot may be
        reused by a concurrent write. For a background thread (it does the tier reads).
        Never raises for tier failures."""
        if not keys or self.host_slab() is None:
            return 0
        pin = self.pin_host
        flags = pin(keys)
        missing = [j for j, f in enumerate(flags) if not f]
        room = self._call(0, lambda t: t.available_slots(), 0) if missing else 0  # type: ignore[attr-defined]
        if missing and len(missing) <= room:  # else they would evict each other: caller reads
            values = self._read([keys[j] for j in missing], decoded=False, promote_hits=False,
                                first_tier=1)
            got = [(keys[j], v) for j, v in zip(missing, values, strict=True) if v is not None]
            if got:
                self._write(0, [(k, v if isinstance(v, bytes) else bytes(v)) for k, v in got])
                again = pin([k for k, _ in got])
                pinned = {k for (k, _), f in zip(got, again, strict=True) if f}
                flags = [f or keys[j] in pinned for j, f in enumerate(flags)]
        n = next((j for j, f in enumerate(flags) if not f), len(keys))
        self.unpin_host([k for k, f in zip(keys[n:], flags[n:], strict=True) if f])
        return n

    def pin_host(self, keys: Sequence[str]) -> list[bool]:
        """Pin each of ``keys`` the host tier holds (``pin_each``); True where pinned. All False
        without a slab tier or on a failure. Balance with ``unpin_host`` of the pinned ones."""
        if not keys or self.host_slab() is None:
            return [False] * len(keys)
        flags = self._call(0, lambda t: t.pin_each(keys), None)  # type: ignore[attr-defined]
        return list(flags) if flags is not None else [False] * len(keys)

    def unpin_host(self, keys: Sequence[str]) -> None:
        """Undo ``stage_host``'s and ``locate_host``'s pins. Never raises for tier failures."""
        if keys:
            self._call(0, lambda t: t.unpin(keys), None)  # type: ignore[attr-defined]

    def reserve_host(self, key: str, nbytes: int) -> Any:
        """A host slot to write ``key`` in place (``tiers.host.Reservation``), or None (no slab
        tier, present, too big, no room, tier failure). Evictions are demoted at once."""
        slab = self.host_slab()
        if slab is None:
            return None
        res = self._call(0, lambda t: slab.reserve(key, nbytes), None)
        if res is not None and res.evicted:
            self._stats[0].add("evictions", len(res.evicted))
            self._movers.demote(0, res.evicted)
        return res

    def commit_host(self, key: str, nbytes: int) -> bool:
        """Make a reserved slot visible (its bytes must be a whole encoded block)."""
        slab = self.host_slab()
        t0 = time.perf_counter()
        ok = bool(slab is not None and self._call(0, lambda t: slab.commit(key), False))
        if ok:
            self._stats[0].record_write(nbytes, time.perf_counter() - t0)
        return ok

    def abort_host(self, key: str) -> None:
        """Free a reserved slot (the copy into it failed)."""
        slab = self.host_slab()
        if slab is not None:
            self._call(0, lambda t: slab.abort(key), None)

    def _read(self, keys: Sequence[str], decoded: bool, promote_hits: bool = True,
              first_tier: int = 0) -> list[Value | None]:
        out: list[Value | None] = [None] * len(keys)
        remaining = list(range(len(keys)))
        promote: list[tuple[str, bytes]] = []
        for i, tier in enumerate(self.tiers):
            if not remaining:
                break
            if i < first_tier:
                continue
            wanted = [keys[j] for j in remaining]
            t0 = time.perf_counter()
            values = self._call(i, lambda t, w=wanted: t.get_many(w), _SKIP)
            if values is _SKIP:
                continue
            seconds = time.perf_counter() - t0
            still, corrupt, nbytes = [], [], 0
            for j, value in zip(remaining, values, strict=False):  # a tier's answer
                if value is None:
                    still.append(j)
                    continue
                nbytes += len(value)
                try:
                    block = decode_block(value, self.config.namespace)
                    out[j] = block.payload if decoded else value
                except CodecError as exc:
                    log.warning("tier %s: corrupt block %s (%s)", tier.name, keys[j], exc.reason)
                    corrupt.append(keys[j])
                    still.append(j)
                    continue
                if i > 0 and promote_hits and self.config.promote_on_get:
                    promote.append((keys[j], value if isinstance(value, bytes) else bytes(value)))
            stats = self._stats[i]
            stats.record_read(len(remaining) - len(still), len(still), nbytes, seconds)
            if corrupt:
                stats.add("corrupt", len(corrupt))
                self._call(i, lambda t, c=corrupt: t.delete_many(c), 0)
            remaining = still
        if promote:
            self._movers.promote(promote)
        return out

    # -- writes --------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[str, Value]]) -> int:
        """Write encoded blocks (``codec.encode_block``) to the top tier; return how many were
        written. Keys another ``put_many`` is writing, and repeats, are skipped. Never raises
        for tier failures (a failed write is counted and returns 0). With ``write_through_to``
        the count is what that tier accepted: 0 means the blocks are not durable."""
        with self._lock:
            mine: list[tuple[str, Value]] = []
            for key, value in items:
                if key not in self._writing:
                    self._writing.add(key)
                    mine.append((key, value))
        try:
            if not mine:
                return 0
            through = self.config.write_through_to
            written = self._write(0, mine)
            if through is not None and through > 0:
                # The durable tier decides the answer: the top is a cache in front of it.
                written = self._write(through, mine)
            return max(written, 0)
        finally:
            with self._lock:
                self._writing.difference_update(k for k, _ in mine)

    def delete_many(self, keys: Sequence[str]) -> int:
        """Delete ``keys`` from every tier (pinned entries stay where a tier keeps pins).
        Returns the largest count any one tier reported. Never raises for tier failures."""
        if not keys:
            return 0
        return max(self._call(i, lambda t: t.delete_many(keys), 0)
                   for i in range(len(self.tiers)))

    def prepare_store(self, keys: Sequence[str]) -> list[str]:
        """The keys this caller should store: not at the top tier and not being stored by
        someone else. They stay reserved until ``complete_store``."""
        with self._lock:
            fresh = [k for k in dict.fromkeys(keys) if k not in self._storing
                     and k not in self._writing]
            self._storing.update(fresh)
        present = {k for k in fresh if self._call(0, lambda t, k=k: t.contains(k), False)}
        if present:
            with self._lock:
                self._storing.difference_update(present)
        return [k for k in fresh if k not in present]

    def complete_store(self, keys: Sequence[str], success: bool) -> None:
        """Release keys from ``prepare_store``; ``success`` is for the caller's bookkeeping:
        the bytes are visible as soon as ``put_many`` (or a host ``commit``) returned."""
        with self._lock:
            self._storing.difference_update(keys)

    def prepare_load(self, keys: Sequence[str]) -> int:
        """Pin each key in every pin-capable tier holding it (one ``pin_each`` call per tier);
        return how many leading keys are pinned somewhere. Balance with ``complete_load(keys)``.
        Never raises for tier failures (a failed tier pins nothing)."""
        pinned_somewhere = [False] * len(keys)
        for i, tier in enumerate(self.tiers):
            if not keys or not isinstance(tier, PinningTier):
                continue
            flags = self._call(i, lambda t: t.pin_each(keys), None)  # type: ignore[attr-defined]
            if flags is None:
                continue
            with self._lock:
                for j, (key, pinned) in enumerate(zip(keys, flags, strict=True)):
                    if pinned:
                        pinned_somewhere[j] = True
                        self._load_pins[(i, key)] += 1
        return next((j for j, p in enumerate(pinned_somewhere) if not p), len(keys))

    def complete_load(self, keys: Sequence[str]) -> None:
        """Undo ``prepare_load``'s pins for ``keys`` (one ``unpin`` call per tier)."""
        unpin: list[list[str]] = [[] for _ in self.tiers]
        with self._lock:
            for key in keys:
                for i in range(len(self.tiers)):
                    if self._load_pins[(i, key)] == 0:  # a Counter reads 0 without inserting
                        continue
                    self._load_pins[(i, key)] -= 1
                    if self._load_pins[(i, key)] == 0:
                        del self._load_pins[(i, key)]
                    unpin[i].append(key)
        for i, mine in enumerate(unpin):
            if mine:
                self._call(i, lambda t, m=mine: t.unpin(m), None)  # type: ignore[attr-defined]

    # -- background ----------------------------------------------------------------------

    def _write(self, i: int, items: Sequence[tuple[str, Value]]) -> int:
        """Write to tier i (in the caller's thread); demote what it evicted. Returns count, or
        -1 when the tier failed or was backing off (nothing written, nothing demoted)."""
        t0 = time.perf_counter()
        evicted = self._call(i, lambda t: t.put_many(items), _SKIP)
        if evicted is _SKIP:
            return -1
        stats = self._stats[i]
        stats.record_write(sum(len(v) for _, v in items), time.perf_counter() - t0)
        if evicted:
            stats.add("evictions", len(evicted))
            self._movers.demote(i, evicted)
        return len(items)

    def _call(self, i: int, fn: Callable[[Tier], T], default: T) -> T:
        """Run ``fn`` on tier i unless it is backing off; a failure counts and backs off."""
        return call_with_backoff(self.tiers[i], fn, default, name=self.tiers[i].name,
                                 stats=self._stats[i], health=self._health[i])

    # -- lifecycle and stats -------------------------------------------------------------

    def flush(self) -> None:
        """Wait until promotions and demotions queued so far are written (tests use it)."""
        self._movers.flush()

    def _tier_rows(self) -> list[dict[str, Any]]:
        rows = [s.snapshot() for s in self._stats]
        for i, (row, health) in enumerate(zip(rows, self._health, strict=True)):
            row["queue_batches"] = self._movers.queued_batches(i)
            row["consecutive_failures"] = health.consecutive_failures
        return rows

    def tier_usage(self) -> dict[str, TierUsage]:
        """Each tier's ``usage()`` by its stats name; a tier that fails or backs off is left
        out. Asks the tiers (Redis/S3: a server round trip), so not for hot paths."""
        out: dict[str, TierUsage] = {}
        for i, s in enumerate(self._stats):
            usage = self._call(i, lambda t: t.usage(), None)
            if usage is not None:
                out[s.name] = usage
        return out

    def stats(self) -> dict[str, Any]:
        with self._lock:
            in_flight = len(self._storing | self._writing)
            pins = sum(self._load_pins.values())
        return {"tiers": self._tier_rows(), "in_flight_stores": in_flight, "load_pins": pins}

    def close(self) -> None:
        """Drain the queues, stop the workers, unregister metrics, close the tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._movers.stop()
        if self._collector is not None:
            self._registry.unregister(self._collector)
        for tier in self.tiers:
            tier.close()
