"""Host tier: a fixed slab of (pinned) host memory cut into equal slots, LRU-evicted.

The slab is allocated ONCE at construction: ``capacity // slot_bytes`` slots of ``slot_bytes``
(the largest encoded block, ``cachestore.codec.encoded_size``). With CUDA the slab is pinned
(page-locked) so GPU<->host copies run at link speed; on CPU it is plain memory. No allocation
happens afterwards, so a full tier never fragments and never grows.

- LRU: ``lookup``, ``get_many`` and ``put_many`` refresh recency. When no slot is free, ``put_many``
  evicts the least recently used *unpinned, committed* entry and returns it (with a copy of its
  bytes, since the slot is reused at once) so the store can demote it; clean first: an entry
  the tier below already holds (``held_below``) among the ``CLEAN_FIRST`` least recent goes
  before them, with nothing copied.
- Re-saves: an entry the tier below held when it came in is marked, and so is any entry read
  since (``get_many``, ``locate``); ``resave_outcomes`` counts the marked entries evicted and
  those of them never read (``cachestore.store.resave`` turns re-saving off on it).
- Pins: ``pin``/``unpin`` are counted; a pinned entry is never evicted, deleted or overwritten.
  The store pins between ``prepare_load`` and ``complete_load``.
- Zero copy: ``get_many`` returns memoryviews into the slab. A view stays valid while its entry
  is pinned; unpinned, it is valid until the entry is evicted or overwritten (which only a
  later ``put_many``/``reserve`` can do). Pin before handing a view to a copy engine.
- Direct reads: ``locate(keys, header, nbytes)`` gives the slab offset of each committed entry
  whose stored bytes start with ``header`` (the codec's ``header_bytes``: magic, version,
  lengths, namespace, shape and, for a keyed block, its key: one header per key then) and
  whose size is ``nbytes``, so a device copy can read the payload
  in place. No checksum: this process wrote those bytes; lower tiers keep it.
- Direct writes: ``reserve(key, nbytes)`` hands out a slot's memory (and its offset in
  ``slab_tensor()``) so a GPU->host copy lands in place; ``commit(key)`` makes it visible,
  ``abort(key)`` frees it. Reserved entries are invisible and unevictable until then.
- Shared slab (``shared=True``, Linux, the cache daemon): the slab is a sealed memfd
  (``tiers.host_memfd``) that other processes can map read-only through ``shared_fd()``; a
  reader relies on pins (above) for the bytes of a slot to stay put. No torch tensor then.

Thread-safe: one lock guards the index; copies into the slab happen under it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from threading import Lock
from typing import Any

from tiers.base import Evicted, Tier, TierUsage, Value
from tiers.host_memfd import SharedSlab

# Evictions look this many least recent entries deep for one the tier below holds.
CLEAN_FIRST = 32


@dataclass(slots=True)
class _Entry:
    slot: int
    nbytes: int
    pins: int = 0
    committed: bool = True
    below: bool = False  # the tier below held it when it came in (a re-save)
    read: bool = False  # read since (get_many, locate)


@dataclass(frozen=True, slots=True)
class Reservation:
    """Where to write a reserved block: ``view`` (== slab bytes ``[offset, offset+nbytes)``)."""

    view: memoryview
    offset: int
    evicted: list[Evicted]


class HostTier(Tier):
    name = "host"

    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: int,
        *,
        pin_memory: bool | None = None,
        shared: bool = False,
    ) -> None:
        """Allocate the slab. Raises ValueError when not even one slot fits, OSError when
        ``shared`` memory cannot be had here (no memfd or seals: use private memory)."""
        if slot_bytes <= 0 or capacity_bytes < slot_bytes:
            raise ValueError(
                f"host tier needs capacity >= slot_bytes > 0, got "
                f"capacity={capacity_bytes} slot_bytes={slot_bytes}"
            )
        self.slot_bytes = slot_bytes
        self.num_slots = capacity_bytes // slot_bytes
        self._shared: SharedSlab | None = None
        if shared:
            if pin_memory:
                raise ValueError("a shared host slab cannot be pinned (no CUDA in the daemon)")
            self._shared = SharedSlab.create(self.num_slots * slot_bytes)
            self._tensor, self._slab = None, self._shared.view
        else:
            self._tensor, self._slab = _allocate(self.num_slots * slot_bytes, pin_memory)
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))  # pop() -> slot 0 first
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self._used_bytes = 0
        self.num_oversize_skipped = 0
        self.num_full_skipped = 0  # every slot pinned or reserved
        # ``held_below(key)``: True when the tier below already holds ``key`` (its
        # ``Tier.holds_hint``; the store sets it). Such an entry is evicted without
        # copying its bytes out: the copy would only be dropped there as already present,
        # and it ran on the caller's thread (the engine's, for a save's ``reserve``).
        self.held_below: Callable[[str], bool] | None = None
        # Evictions whose bytes were copied out (the tier below lacked them).
        self.num_copied_out = 0
        self._resaved_evicted = 0  # ``resave_outcomes``
        self._resaved_unread = 0
        self._lock = Lock()

    @classmethod
    def from_config(cls, config: Any) -> HostTier:
        """Registry factory (``tiers.host:HostTier.from_config``) for a ``HostTierConfig``."""
        if config.slot_bytes is None:
            raise ValueError("host tier needs slot_bytes (from the config or the engine)")
        return cls(config.capacity, config.slot_bytes, pin_memory=config.pin_memory)

    @property
    def pinned_memory(self) -> bool:
        return bool(self._tensor is not None and self._tensor.is_pinned())

    def slab_tensor(self) -> Any:
        """The whole slab as a uint8 torch tensor (None without torch). Offsets match reserve."""
        return self._tensor

    def shared_fd(self) -> int | None:
        """The shared slab's sealed memfd (others can only map it read-only; offsets match
        ``locate``), or None for a private slab. Owned by the tier: dup it to keep it."""
        return self._shared.fd if self._shared is not None and self._shared.fd >= 0 else None

    # -- Tier protocol -------------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is None or not entry.committed:
                    return i
                self._entries.move_to_end(key)
            return len(keys)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """One lock hold for the batch; a present key's recency is refreshed, as ``lookup``
        does (a block about to be saved again was just in use)."""
        out: list[bool] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                here = entry is not None and entry.committed
                if here:
                    self._entries.move_to_end(key)
                out.append(here)
        return out

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        out: list[Value | None] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or not entry.committed:
                    out.append(None)
                    continue
                self._entries.move_to_end(key)
                entry.read = True
                start = entry.slot * self.slot_bytes
                out.append(self._slab[start : start + entry.nbytes])
        return out

    def put_many(self, items: Sequence[tuple[str, Value]]) -> list[Evicted]:
        """Write ``items``; returns what left the tier for them: LRU entries evicted to make
        room, and items this tier could not take (too big for a slot, or no slot free or
        evictable: every one pinned or reserved), with their bytes, so that the store passes
        them down like any eviction instead of losing them."""
        evicted: list[Evicted] = []
        with self._lock:
            for key, value in items:
                src = memoryview(value).cast("B")
                if src.nbytes > self.slot_bytes:
                    self.num_oversize_skipped += 1
                    evicted.append(Evicted(key, bytes(src)))
                    continue
                entry = self._entries.get(key)
                if entry is not None:
                    if entry.pins or not entry.committed:
                        continue  # keys are content hashes: the stored bytes are the same
                    self._used_bytes += src.nbytes - entry.nbytes
                    entry.nbytes = src.nbytes
                    self._entries.move_to_end(key)
                else:
                    entry = self._new_entry(key, src.nbytes, evicted, committed=True)
                    if entry is None:  # no room: it goes down, not away
                        evicted.append(Evicted(key, bytes(src)))
                        continue
                start = entry.slot * self.slot_bytes
                self._slab[start : start + src.nbytes] = src
        return evicted

    def delete_many(self, keys: Sequence[str]) -> int:
        """Delete unpinned entries; pinned or reserved ones stay (and are not counted)."""
        removed = 0
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry.committed and not entry.pins:
                    self._drop(key, entry)
                    removed += 1
        return removed

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(
                used_bytes=self._used_bytes,
                capacity_bytes=self.num_slots * self.slot_bytes,
                num_entries=sum(e.committed for e in self._entries.values()),
            )

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._free = []
            self._used_bytes = 0
            self.num_slots = 0  # nothing fits any more; the slab goes with the last view
            self._slab = memoryview(b"")
            self._tensor = None
            if self._shared is not None:
                self._shared.close()

    # -- pins and direct writes ----------------------------------------------------------

    def pin(self, keys: Sequence[str]) -> int:
        """Pin the leading present keys; return how many were pinned (stops at the first miss)."""
        with self._lock:
            for i, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is None or not entry.committed:
                    return i
                entry.pins += 1
            return len(keys)

    def pin_each(self, keys: Sequence[str]) -> list[bool]:
        """Pin every present key, past a missing one too (one lock hold for the batch); True
        where pinned. A key given twice is pinned twice. The store's ``prepare_load`` uses it."""
        out: list[bool] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry.committed:
                    entry.pins += 1
                out.append(entry is not None and entry.committed)
        return out

    def unpin(self, keys: Sequence[str]) -> None:
        """Undo one ``pin`` per key; absent or unpinned keys are ignored."""
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry.pins:
                    entry.pins -= 1

    def locate(
        self,
        keys: Sequence[str],
        header: bytes | Sequence[bytes],
        nbytes: int,
        *,
        pin: bool = False,
    ) -> list[int | None]:
        """Slab offset of each key's entry (None: absent, reserved, another size, or a stored
        header other than ``header``: one for all keys, or one per key -- a keyed block's
        header names its key, ``codec.HeaderTemplate``); refreshes recency of hits. The offset
        is that of the whole encoded block: the payload starts ``len(header)`` bytes later.
        ``pin``: pin each hit in the same lock hold (balance with ``unpin``), so the offset
        stays valid."""
        out: list[int | None] = []
        headers = [header] * len(keys) if isinstance(header, bytes | bytearray) else header
        if len(headers) != len(keys):
            raise ValueError(f"{len(headers)} headers for {len(keys)} keys")
        with self._lock:
            for key, want in zip(keys, headers, strict=True):
                entry = self._entries.get(key)
                if entry is None or not entry.committed or entry.nbytes != nbytes:
                    out.append(None)
                    continue
                start = entry.slot * self.slot_bytes
                if self._slab[start : start + len(want)] != want:
                    out.append(None)
                    continue
                self._entries.move_to_end(key)
                entry.pins += pin
                entry.read = True
                out.append(start)
        return out

    def reserve(self, key: str, nbytes: int) -> Reservation | None:
        """A slot for ``key`` to be written in place; None if present, too big, or no room."""
        with self._lock:
            if key in self._entries or nbytes > self.slot_bytes:
                return None
            evicted: list[Evicted] = []
            entry = self._new_entry(key, nbytes, evicted, committed=False)
            if entry is None:
                return None
            offset = entry.slot * self.slot_bytes
            return Reservation(self._slab[offset : offset + nbytes], offset, evicted)

    def commit(self, key: str, nbytes: int | None = None, *, pin: bool = False) -> bool:
        """Make a reserved entry visible (most recently used). False if it was not reserved.
        ``nbytes``: the block written is that long (at most the reservation's); ``pin``: pin
        it in the same step, so no concurrent write can evict it before its reader pins it."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.committed:
                return False
            if nbytes is not None and nbytes != entry.nbytes:
                if not 0 < nbytes <= self.slot_bytes:
                    return False
                self._used_bytes += nbytes - entry.nbytes
                entry.nbytes = nbytes
            entry.committed = True
            entry.pins += pin
            entry.below = entry.below and not pin  # pinned: a load staging it, not a save
            self._entries.move_to_end(key)
            return True

    def abort(self, key: str) -> None:
        """Free a reserved (uncommitted) slot; a no-op for anything else."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and not entry.committed:
                self._drop(key, entry)

    def num_pins(self) -> int:
        """Pins held over all entries (tests and diagnostics: 0 when no reader holds one)."""
        with self._lock:
            return sum(e.pins for e in self._entries.values())

    def resave_outcomes(self) -> tuple[int, int]:
        """Entries evicted so far that the tier below held when they came in (re-saves), and
        how many of them were never read here (``cachestore.store.resave``)."""
        with self._lock:
            return self._resaved_evicted, self._resaved_unread

    def available_slots(self) -> int:
        """Slots a write could take now: free ones plus committed, unpinned entries."""
        with self._lock:
            return len(self._free) + sum(e.committed and not e.pins for e in self._entries.values())

    def lru_keys(self) -> list[str]:
        """Committed keys, least recently used first (for tests and debugging)."""
        with self._lock:
            return [k for k, e in self._entries.items() if e.committed]

    def check_integrity(self) -> None:
        """Assert free + used slots == all slots, each slot owned once, byte count exact."""
        with self._lock:
            slots = [e.slot for e in self._entries.values()] + self._free
            assert sorted(slots) == list(range(self.num_slots)), "slot accounting broken"
            assert self._used_bytes == sum(e.nbytes for e in self._entries.values())

    # -- internals (lock held) -----------------------------------------------------------

    def _new_entry(
        self, key: str, nbytes: int, evicted: list[Evicted], committed: bool
    ) -> _Entry | None:
        if not self._free and not self._evict_one(evicted):
            self.num_full_skipped += 1
            return None
        below = self._is_held_below(key)
        entry = _Entry(slot=self._free.pop(), nbytes=nbytes, committed=committed, below=below)
        self._entries[key] = entry
        self._used_bytes += nbytes
        return entry

    def _evict_one(self, evicted: list[Evicted]) -> bool:
        """Evict the least recently used evictable entry, preferring, among the
        ``CLEAN_FIRST`` least recent, one the tier below already holds (clean-first LRU): a
        block the tier below lacks is copied out here, on the caller's thread (the engine's,
        for a save's ``reserve``), and demoted, while the write-through lane may be about to
        write it anyway."""
        victim: tuple[str, _Entry] | None = None
        clean, seen = False, 0
        for key, entry in self._entries.items():
            if not entry.committed or entry.pins:
                continue
            if self._is_held_below(key):
                victim, clean = (key, entry), True
                break
            if victim is None:
                victim = (key, entry)
            seen += 1
            if seen >= CLEAN_FIRST or self.held_below is None:
                break
        if victim is None:
            return False
        key, entry = victim
        if entry.below:
            self._resaved_evicted += 1
            self._resaved_unread += not entry.read
        if clean:
            evicted.append(Evicted(key, None, held_below=True))
        else:
            start = entry.slot * self.slot_bytes
            # Copied out: the slot is about to be reused for the incoming block.
            evicted.append(Evicted(key, bytes(self._slab[start : start + entry.nbytes])))
            self.num_copied_out += 1
        self._drop(key, entry)
        return True

    def _is_held_below(self, key: str) -> bool:
        if self.held_below is None:
            return False
        try:
            return self.held_below(key)
        except Exception:  # the tier below failing: copy the bytes out as without it
            return False

    def _drop(self, key: str, entry: _Entry) -> None:
        del self._entries[key]
        self._used_bytes -= entry.nbytes
        self._free.append(entry.slot)


def _allocate(num_bytes: int, pin_memory: bool | None) -> tuple[Any, memoryview]:
    """The slab as (torch uint8 tensor or None, writable memoryview over the same bytes)."""
    try:
        import torch
    except ImportError:  # torch-less deployments (e.g. a cache server) still get a host tier
        if pin_memory:
            raise ValueError("pin_memory=True needs torch with CUDA") from None
        return None, memoryview(bytearray(num_bytes))
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    tensor = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin_memory)
    return tensor, tensor.numpy().data.cast("B")
