"""The hierarchical store's host fast path: in-place reads and writes of the host tier's slab.

Active when the store's top tier is a ``SlabTier`` (the pinned host tier); otherwise every call
answers "nothing" (None, False, 0). What the offload connector uses:
- ``locate``: slab offsets of host blocks whose codec header matches (no checksum: this process
  wrote them), each hit pinned, so the caller copies payloads straight out of the slab.
- ``stage``: reads the blocks the host tier lacks from the lower tiers straight into reserved
  slab slots (one copy, checksummed in place, no promotion) and pins them there, but only
  when they all fit; a large batch is read in chunks by a few threads at once (the tiers'
  copies and the checksum run without the GIL).
- ``pin`` / ``unpin``: pins on the host tier alone (not counted as ``prepare_load`` pins).
- ``reserve`` / ``commit`` / ``abort``: a device copy lands in a host slot in place; the slot's
  evictions go to the demotion queue, as for ``put_many``.

Thread-safe as far as the slab tier is (it locks itself); ``stage`` does tier reads, so it is
for a background thread. Never raises for tier failures. Torch-free.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from cachestore.store.guarded_tiers import GuardedTiers
from cachestore.store.types import SlabTier
from tiers.base import Evicted

# Read keys into the caller's buffers (``HierarchicalStore.get_many_into`` from the tier below
# the top, no promotion): each value's length, or None for a miss.
ReadIntoFn = Callable[[Sequence[str], Sequence[memoryview]], list[int | None]]
# Blocks per chunk of a parallel stage (2 MiB blocks: 32 MiB), and its threads at most.
STAGE_CHUNK_BLOCKS = 16
STAGE_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))


class HostFastPath:
    def __init__(
        self,
        tiers: GuardedTiers,
        read_lower_into: ReadIntoFn,
        demote: Callable[[list[Evicted]], None],
        stage_threads: int = STAGE_THREADS,
    ) -> None:
        """``read_lower_into(keys, views)``: checksummed reads from the tiers below the top
        straight into ``views``, no promotion; ``stage_threads``: readers of a large stage;
        ``demote(evicted)``: queue what the top tier evicted for the tier below."""
        self._tiers = tiers
        self._read_lower_into = read_lower_into
        self._stage_threads = stage_threads
        self._pool: cf.ThreadPoolExecutor | None = None  # started by the first large stage
        self._closed = False  # after close: stages run on the caller's thread
        self._demote = demote
        top = tiers.tiers[0]
        self.slab: SlabTier | None = top if isinstance(top, SlabTier) else None

    def locate(
        self, keys: Sequence[str], header: bytes | Sequence[bytes], nbytes: int
    ) -> list[int | None]:
        """Slab offsets of ``keys`` in the host tier (``SlabTier.locate``), each hit pinned
        there (balance with ``unpin`` of the hits); all None without a slab tier or when it
        fails. Counts hits like a read."""
        slab = self.slab
        if slab is None or not keys:
            return [None] * len(keys)
        t0 = time.perf_counter()
        out = self._tiers.call(0, lambda t: slab.locate(keys, header, nbytes, pin=True), None)
        if out is None:
            return [None] * len(keys)
        hits = sum(o is not None for o in out)
        self._tiers.stats[0].record_read(
            hits, len(keys) - hits, hits * nbytes, time.perf_counter() - t0
        )
        return out

    def keep_run(self, keys: Sequence[str], offsets: Sequence[int | None]) -> tuple[int, ...]:
        """The leading run of ``locate``'s ``offsets`` for ``keys`` (up to the first miss); the
        pins of hits past it are undone at once."""
        lead = next((i for i, o in enumerate(offsets) if o is None), len(offsets))
        self.unpin([k for k, o in zip(keys[lead:], offsets[lead:], strict=True) if o is not None])
        return tuple(o for o in offsets[:lead] if o is not None)

    def stage(self, keys: Sequence[str]) -> int:
        """Pin ``keys`` in the host tier, reading the ones it lacks from the lower tiers and
        writing them there first when they all fit beside the pinned and reserved entries;
        return how many leading keys are now pinned in the host tier (pins past those are
        undone). Balance with ``unpin(keys[:n])``. Never reads host bytes unpinned: a slot may
        be reused by a concurrent write."""
        if not keys or self.slab is None:
            return 0
        flags = self.pin(keys)
        missing = [j for j, f in enumerate(flags) if not f]
        room = self._tiers.call(0, lambda t: t.available_slots(), 0) if missing else 0  # type: ignore[attr-defined]
        if missing and len(missing) <= room:  # else they would evict each other: caller reads
            pinned = self._place_lower([keys[j] for j in missing])
            flags = [f or keys[j] in pinned for j, f in enumerate(flags)]
        n = next((j for j, f in enumerate(flags) if not f), len(keys))
        self.unpin([k for k, f in zip(keys[n:], flags[n:], strict=True) if f])
        return n

    def _place_lower(self, keys: Sequence[str]) -> set[str]:
        """Reserve a slot per key (stopping at the first refused), read the lower tiers into
        the slots, commit each block read whole and pinned; the keys now pinned here."""
        slab = self.slab
        assert slab is not None
        slots: list[tuple[str, Any]] = []
        for key in keys:
            res = self.reserve(key, slab.slot_bytes)
            if res is None:
                break
            slots.append((key, res))
        chunks = [
            slots[i : i + STAGE_CHUNK_BLOCKS] for i in range(0, len(slots), STAGE_CHUNK_BLOCKS)
        ]
        pool = self._pool
        if len(chunks) > 1 and self._stage_threads > 1 and not self._closed:
            if pool is None:
                pool = self._pool = cf.ThreadPoolExecutor(self._stage_threads, "kvtier-store-stage")
            futures: list[cf.Future[set[str]]] = []
            for chunk in chunks:
                try:
                    futures.append(pool.submit(self._place_chunk, chunk))
                except RuntimeError:  # closed meanwhile: the rest on this thread
                    break
            done = [f.result() for f in futures]
            rest = [self._place_chunk(chunk) for chunk in chunks[len(futures) :]]
            return set().union(*done, *rest)
        return set().union(*map(self._place_chunk, chunks)) if chunks else set()

    def _place_chunk(self, slots: Sequence[tuple[str, Any]]) -> set[str]:
        """One chunk of ``_place_lower``: read into its reserved slots, then commit or abort."""
        try:
            lengths = self._read_lower_into([k for k, _ in slots], [r.view for _, r in slots])
        except Exception:  # never raises for tier failures; anything else: nothing placed
            lengths = [None] * len(slots)
        placed: set[str] = set()
        for (key, res), n in zip(slots, lengths, strict=True):
            if n is not None and n <= res.view.nbytes and self.commit(key, n, pin=True):
                placed.add(key)
            else:
                self.abort(key)
        return placed

    def close(self) -> None:
        """Stop the stage threads (idempotent)."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def pin(self, keys: Sequence[str]) -> list[bool]:
        """Pin each of ``keys`` the host tier holds (``pin_each``); True where pinned. All False
        without a slab tier or on a failure. Balance with ``unpin`` of the pinned ones."""
        if not keys or self.slab is None:
            return [False] * len(keys)
        flags = self._tiers.call(0, lambda t: t.pin_each(keys), None)  # type: ignore[attr-defined]
        return list(flags) if flags is not None else [False] * len(keys)

    def unpin(self, keys: Sequence[str]) -> None:
        """Undo ``stage``'s, ``locate``'s and ``pin``'s pins."""
        if keys:
            self._tiers.call(0, lambda t: t.unpin(keys), None)  # type: ignore[attr-defined]

    def reserve(self, key: str, nbytes: int) -> Any:
        """A host slot to write ``key`` in place (``tiers.host.Reservation``), or None (no slab
        tier, present, too big, no room, tier failure). Evictions are demoted at once."""
        slab = self.slab
        if slab is None:
            return None
        res = self._tiers.call(0, lambda t: slab.reserve(key, nbytes), None)
        if res is not None and res.evicted:
            self._tiers.stats[0].add("evictions", len(res.evicted))
            self._demote(res.evicted)
        return res

    def commit(self, key: str, nbytes: int, pin: bool = False) -> bool:
        """Make a reserved slot visible (its bytes must be a whole encoded block of ``nbytes``,
        at most the reservation's; ``pin``: pinned as it becomes visible); counted as a write of
        ``nbytes``. False when it failed."""
        slab = self.slab
        t0 = time.perf_counter()
        ok = bool(
            slab is not None
            and self._tiers.call(0, lambda t: slab.commit(key, nbytes, pin=pin), False)
        )
        if ok:
            self._tiers.stats[0].record_write(nbytes, time.perf_counter() - t0)
        return ok

    def abort(self, key: str) -> None:
        """Free a reserved slot (the copy into it failed)."""
        slab = self.slab
        if slab is not None:
            self._tiers.call(0, lambda t: slab.abort(key), None)
