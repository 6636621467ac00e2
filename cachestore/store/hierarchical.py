"""The hierarchical store: one ordered list of tiers (top = fastest) behind one API.

- ``lookup`` says, per tier, how many leading keys it holds, and for the chain which tier serves
  each leading block (the first tier holding it); the chain is the longest prefix available
  across all tiers.
- ``get_many`` reads top-down, decodes through the codec (checksum, namespace), and queues
  hits from lower tiers for promotion into the top tier (asynchronous).
- ``get_many_encoded`` is the same read but returns the still-encoded blocks (validated first):
  what a cache server hands on to its clients.
- ``get_many_into`` is that read into buffers the caller owns (pinned staging, slab slices):
  each tier copies its hits straight into them (``Tier.get_many_into``), then they are checked.
- ``get_many_pinned`` (``read_pinned``, its context): the read for callers that use the values
  while other threads write: a host-tier block is read only once pinned for this caller (others
  come from the lower tiers, owned), so no concurrent put, eviction or delete can reuse its slot
  under the view.
- ``put_many`` writes encoded blocks to the top tier and, with ``write_through_to`` set,
  synchronously to that (durable) tier too before returning. Evictions from tier i are demoted
  to tier i+1 in the background, never blocking the caller (``cachestore.store.demotion``); a key the
  tier below already holds is not rewritten (one ``contains_many`` per batch;
  ``cachestore.store.writes``).
- Write policies (``StoreConfig.write_policies``, ``cachestore.store.write_through``): blocks saved to
  the top tier (``put_many``, ``commit_host``) are copied asynchronously to each write-through
  tier below, or at their N-th hit for a selective one; write-back tiers get them on eviction.
  ``shutdown_writes`` drains those queues (bounded) and flushes host-only blocks down to the
  first tier below the top: a graceful shutdown keeps what the host tier held.
- Pins (``cachestore.store.host_loads``): the host fast path (``*_host``), prepared loads
  (``prepare_load`` -> ``LoadSpec`` ... ``complete_load``, the one owner of a load's pins) and
  in-flight stores (``prepare_store``/``complete_store``). ``put_many`` skips a key another
  ``put_many`` is writing; a concurrent ``get_many`` of a key being stored MISSES; it never waits.
- Failures: a TierError (or any exception) from a tier is a miss or a skipped write plus an
  ``errors`` count, never an exception to the caller (``cachestore.store.guarded_tiers``); a
  CodecError is a miss plus ``corrupt``, and the bad value is deleted; a keyed block read
  under another key (``codec``, version 2; ``StoreConfig.block_key_skip``) is such a miss,
  counted ``wrong_key`` too. A failing tier is skipped
  with exponential backoff (``TierHealth``), then probed again. ``on_drop`` hears of keys
  dropped at the bottom.

Thread-safe. Torch-free. The store owns its tiers: ``close`` closes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from cachestore.store.demotion import TierMovers
from cachestore.store.guarded_tiers import GuardedTiers
from cachestore.store.host import HostFastPath
from cachestore.store.host_loads import HostLoads
from cachestore.store.inflight import InFlight
from cachestore.store.loads import LoadLeases
from cachestore.store.metrics import register_prometheus
from cachestore.store.pins import StorePins
from cachestore.store.prober import TierProber
from cachestore.store.reads import StoreReads, lookup_chain
from cachestore.store.resave import ResaveGate
from cachestore.store.types import LookupResult, StoreConfig, TierLookup, WritePolicy
from cachestore.store.write_through import DrainReport, WriteThrough
from cachestore.store.writes import TierWrites, flush_on_shutdown
from tiers.base import Tier, TierUsage, Value

__all__ = ["HierarchicalStore", "LookupResult", "StoreConfig", "TierLookup"]  # old import paths


class HierarchicalStore(HostLoads):
    def __init__(
        self,
        tiers: Sequence[Tier],
        config: StoreConfig,
        *,
        registry: Any = None,
        clock: Callable[[], float] = time.monotonic,
        on_drop: Callable[[list[str]], None] | None = None,
    ) -> None:
        """Start one worker per tier. ``registry``: a prometheus_client CollectorRegistry.
        ``on_drop(keys)`` is called (from the writing thread) with keys the last tier evicted.
        Raises ValueError for no tiers or a ``write_through_to`` past the last tier."""
        self._tiers = GuardedTiers(tiers, config, clock)
        if config.write_through_to is not None and config.write_through_to >= len(tiers):
            raise ValueError(
                f"write_through_to={config.write_through_to} but only {len(tiers)} tier(s)"
            )
        self.tiers = self._tiers.tiers
        self.config = config
        self._stats = self._tiers.stats
        self._call = self._tiers.call
        self._pins = StorePins(self._tiers)
        self._resave: ResaveGate | None = None
        below = self.tiers[1] if len(self.tiers) > 1 else None
        if below is not None and hasattr(self.tiers[0], "held_below"):
            # The host tier evicts what the tier below already holds (write-through) without
            # copying it out, and first: ``tiers.host.HostTier.held_below``. Only a tier that
            # answers from memory (the default ``holds_hint`` always says no).
            if type(below).holds_hint is not Tier.holds_hint:
                self.tiers[0].held_below = below.holds_hint
            outcomes = getattr(self.tiers[0], "resave_outcomes", None)
            if callable(outcomes):
                self._resave = ResaveGate(outcomes)
        # Demoted blocks queued for a tier and not yet written: read as that tier's.
        self._inflight = InFlight(len(self.tiers))
        self._start_writers(on_drop)
        self._start_readers()
        self._collector = None
        if registry is not None:
            self._collector = register_prometheus(registry, self._tier_rows)
        self._registry = registry
        self._prober: TierProber | None = None
        if config.probe_interval_s > 0:
            self._prober = TierProber(self._tiers, config.probe_interval_s)
            self._prober.start()
        self._closed = False
        # What ``shutdown_writes`` did, once it ran: the engine core's exit code reports it.
        self.drain_report: DrainReport | None = None

    def _start_writers(self, on_drop: Callable[[list[str]], None] | None) -> None:
        """The write side: one tier's write, the movers (promotions up, evictions one tier
        down, ``on_drop`` below the last) and the write-through lanes of each tier's policy."""
        self._writes = TierWrites(self._tiers, lambda i, evicted: self._movers.demote(i, evicted))
        self._write = self._writes.write
        self._movers = TierMovers(
            self._stats,
            self._tiers.health,
            self.config.queue_batches,
            self._writes.write_back,
            on_drop,
            self._inflight,
        )
        num_tiers = len(self.tiers)
        policies = list(self.config.write_policies[:num_tiers])
        policies += [WritePolicy()] * (num_tiers - len(policies))
        self._through = WriteThrough(
            self._tiers,
            policies,
            self._write,
            read_lower=lambda keys: self._read(
                keys, decoded=False, promote_hits=False, first_tier=1, count_hits=False
            ),
        )

    def _start_readers(self) -> None:
        """The read side: the host fast path, the prepared loads over it, and the reads."""
        self._host = HostFastPath(
            self._tiers,
            read_lower_into=lambda keys, views: self._reads.read_into(
                keys, views, first_tier=1, promote=False
            ),
            demote=lambda evicted: self._movers.demote(0, evicted),
        )
        self._loads = LoadLeases(
            self._pins,
            self._host.unpin,
            self._locate_host_run,
            # Through the method, so a test may replace ``stage_host`` on the store.
            stage=lambda keys: self.stage_host(keys),
        )
        self._reads = StoreReads(
            self._tiers,
            self._host,
            lambda: self.config,
            self._movers.promote,
            self._through.hit,
            self._inflight,
        )

    # -- reads ---------------------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> LookupResult:
        """Which tier serves each block of the longest available prefix of ``keys``.
        Side-effect free but for LRU refreshes inside tiers. Never raises for tier failures.

        A tier is asked only from the first block the tiers above it lack: when the host tier
        holds the whole prefix, LMDB, Redis and S3 are not asked at all (a lookup sits on the
        scheduler's step path). ``per_tier[i].num_leading`` is what tier i answered to its
        first question (0 when it was never asked)."""
        return lookup_chain(self._tiers, keys, self._inflight)

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        """Decoded payloads (``None`` = miss), top tier first. Never raises for tier failures.

        A payload from the host tier is a view into its slab: stable only while its entry is
        pinned *for this caller*; a concurrent put may evict it and reuse the slot for another
        key at any time otherwise (even right after a ``prepare_load`` that found the key
        absent). Callers sharing the store with writers use ``get_many_pinned``. Others are
        owned bytes.
        """
        return self._read(keys, decoded=True)

    def get_many_encoded(self, keys: Sequence[str]) -> list[Value | None]:
        """Like ``get_many`` (same checks, promotion, counters, view lifetime) but each hit is
        the whole encoded block, checksum and namespace already verified; a block that fails
        them is a miss and is deleted, exactly as in ``get_many``."""
        return self._read(keys, decoded=False)

    def get_many_pinned(
        self, keys: Sequence[str], decoded: bool = False
    ) -> tuple[list[Value | None], list[str]]:
        """``get_many_encoded`` (``decoded``: ``get_many``) whose values stay valid while
        other threads write: returns (values, pinned) where ``pinned`` are the keys this call
        pinned in the host tier; balance with ``unpin_host(pinned)`` once done with the values
        (``read_pinned`` does).

        A key is read from the host tier only when this call pinned it there first (one
        ``pin_each``): a key the host tier lacked at that moment is read from the lower tiers
        (owned bytes, promoted as usual) even if a concurrent put has placed it in the host
        tier since -- a host view of an entry nobody pinned for us may be evicted and its slot
        reused by another key while the caller still copies it. Without a
        slab tier on top this is ``_read`` and ``pinned`` is empty. Never raises for tier
        failures."""
        return self._reads.read_pinned(keys, decoded)

    @contextlib.contextmanager
    def read_pinned(
        self, keys: Sequence[str], decoded: bool = False
    ) -> Iterator[list[Value | None]]:
        """``get_many_pinned`` as a context: its values stay valid inside, its pins are
        released on the way out."""
        values, pinned = self._reads.read_pinned(keys, decoded)
        try:
            yield values
        finally:
            self._host.unpin(pinned)

    def get_many_into(
        self, keys: Sequence[str], out: Sequence[Any], *, promote: bool = True
    ) -> list[int | None]:
        """Read each of ``keys`` straight into ``out[i]``, the caller's buffer (writable,
        C-contiguous: a bytearray, a memoryview slice of one staging buffer, a numpy row of a
        pinned tensor); the same read as ``get_many_encoded`` otherwise. Returns per key:

        - the encoded block's length ``n`` when ``n <= len(out[i])`` (bytes): ``out[i][:n]`` is
          the whole encoded block, checksum, namespace and key verified, byte-identical to what
          ``get_many_encoded`` returns. Its payload sits at ``[header_size : n - 8]``: a caller
          expecting one layout compares ``out[i][:header_size]`` with its
          ``HeaderTemplate.for_key(key)`` (the store checks namespace and key, not dtype or
          shape);
        - ``None`` for a miss in every tier (absent, failing, backing off, or corrupt there);
        - a length above ``len(out[i])``: the first tier holding the key holds a block too large
          for the buffer; nothing was written or verified, no lower tier was asked, counted a
          miss. Read it with ``get_many_encoded`` or a larger buffer.

        Bytes of ``out[i]`` past the returned length, and all of a miss's buffer, are undefined
        (a corrupt value a tier above held may have been copied there). Tiers are asked top
        first, each for what the tiers above missed, each copying into the buffers with
        ``Tier.get_many_into`` (LMDB straight from the map; the host tier only under a pin
        taken for this call, so a concurrent put cannot reuse the slot mid-copy; Redis, S3 and
        remote through their ``get_many``). A value failing the codec is a miss of that tier,
        counted ``corrupt`` and deleted from it, and the next tier is asked. Hits below the
        top are promoted to the top tier asynchronously (``promote_on_get``) from one copy
        the store makes (the caller may reuse ``out`` as soon as this returns); ``promote``
        False skips that copy (a caller that puts the blocks back into the top tier itself,
        as the offload connector's saves do once the GPU frees them). Counters as
        ``get_many``. Raises ValueError (one line) when ``out`` and ``keys`` differ in length
        or a buffer is read-only or not contiguous; never raises for tier failures.
        Thread-safe; concurrent calls must not share buffers."""
        return self._reads.read_into(keys, out, promote=promote)

    def _read(
        self,
        keys: Sequence[str],
        decoded: bool,
        promote_hits: bool = True,
        first_tier: int = 0,
        count_hits: bool = True,
        owned: bool = False,
    ) -> list[Value | None]:
        """``StoreReads.read``: top tier first, checked, lower-tier hits promoted."""
        return self._reads.read(keys, decoded, promote_hits, first_tier, count_hits, owned)

    def scope_block_keys(self, skip: int) -> None:
        """From now on, check keyed blocks against their store key less its ``skip`` leading
        ``/`` components (``StoreConfig.block_key_skip``): the cache daemon's store keys are
        ``tenant/`` + the client's key, the key its clients' blocks carry. Thread-safe (one
        reference swap); for the store's owner, before it serves."""
        if self.config.block_key_skip != skip:
            self.config = dataclasses.replace(self.config, block_key_skip=skip)

    # -- writes --------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[str, Value]]) -> int:
        """Write encoded blocks (``codec.encode_block``) to the top tier; return how many were
        written. Keys another ``put_many`` is writing, and repeats, are skipped. Never raises
        for tier failures (a failed write is counted and returns 0). With ``write_through_to``
        the count is what that tier accepted: 0 means the blocks are not durable."""
        mine = self._pins.claim_writes(items)
        try:
            if not mine:
                return 0
            through = self.config.write_through_to
            written = self._write(0, mine)
            if written > 0:
                self._through.saved([k for k, _ in mine])
            if through is not None and through > 0:
                # The durable tier decides the answer: the top is a cache in front of it.
                written = self._write(through, mine)
            return max(written, 0)
        finally:
            self._pins.release_writes(mine)

    def worth_saving(self, keys: Sequence[str]) -> list[str]:
        """``keys`` less the blocks a lower tier holds while the top tier evicts such re-saved
        blocks unread (``cachestore.store.resave``): saving those again into the top tier
        costs a copy and a checksum and evicts another block for nothing. Counted
        ``resave_bypassed`` on the top tier. Order kept."""
        if self._resave is None or not keys:
            return list(keys)
        lower = self.tiers[1:]
        out = self._resave.filter(keys, lambda k: any(t.holds_hint(k) for t in lower))
        if len(out) < len(keys):
            self._stats[0].add("resave_bypassed", len(keys) - len(out))
        return out

    def delete_many(self, keys: Sequence[str]) -> int:
        """Delete ``keys`` from every tier (pinned entries stay where a tier keeps pins).
        Returns the largest count any one tier reported. Never raises for tier failures."""
        if not keys:
            return 0
        self._inflight.drop(keys)  # a queued demotion is no longer read (its write may still land)
        return max(self._call(i, lambda t: t.delete_many(keys), 0) for i in range(len(self.tiers)))

    def skip_tiers(self, names: Sequence[str]) -> None:
        """Stop demoting into the tiers named (``cachestore.cost.placement``: no block there
        would be worth loading): what the tier above evicts passes on to the tier below,
        and its write-through lane copies nothing; each block not written is counted
        ``placement_skipped`` on the skipped tier (once per path it was kept from). The top
        tier and ``write_through_to`` (an acknowledged put's durable tier) are never skipped;
        blocks already in a skipped tier stay readable; shutdown's flush still writes."""
        durable = self.config.write_through_to
        skipped = frozenset(
            i for i, t in enumerate(self.tiers) if t.name in names and i > 0 and i != durable
        )
        self._writes.skipped = self._through.skipped = skipped

    # -- lifecycle and stats -------------------------------------------------------------

    def flush(self, write_timeout_s: float | None = None) -> None:
        """Wait until promotions, demotions and write-through copies queued so far are written
        (the connector's flush, tests); for the copies, at most ``write_timeout_s`` (None: no
        bound; the copies still queued go on in the background)."""
        self._movers.flush()
        if self._through.active:
            self._through.wait_idle(write_timeout_s)
            self._movers.flush()  # what the write-through tiers evicted meanwhile

    def wait_writes(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the write-through queues to empty; False on timeout."""
        return self._through.wait_idle(timeout_s)

    def shutdown_writes(self, drain_timeout_s: float) -> DrainReport:
        """Graceful shutdown: drain the write-through queues for up to ``drain_timeout_s``, then
        stop them; then copy the host tier's blocks (most recent first) that the first healthy
        tier below it lacks, until another ``drain_timeout_s`` ran out; then wait for the
        demotions that caused. Logs and returns what it did (kept as ``drain_report``). Call
        once, before ``close``; the store still serves reads and writes, but nothing is written
        through any more. Never raises for tier failures."""
        report = flush_on_shutdown(self._tiers, self._through, self._movers.flush, drain_timeout_s)
        self.drain_report = report
        return report

    def _tier_rows(self) -> list[dict[str, Any]]:
        rows = [s.snapshot() for s in self._stats]
        for i, (row, health) in enumerate(zip(rows, self._tiers.health, strict=True)):
            row["queue_batches"] = self._movers.queued_batches(i)
            row["write_queue_depth"] = self._through.queued_blocks(i)
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
        counts = self._pins.counts()
        return {
            "tiers": self._tier_rows(),
            "in_flight_stores": counts.in_flight_stores,
            "load_pins": counts.load_pins,
        }

    def close(self) -> None:
        """Drain the queues, stop the workers, unregister metrics, close the tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._prober is not None:
            self._prober.stop()
        self._host.close()
        self._through.stop()
        self._movers.stop()
        if self._collector is not None:
            self._registry.unregister(self._collector)
        for tier in self.tiers:
            tier.close()
