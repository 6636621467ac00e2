"""The hierarchical store's key bookkeeping: keys in flight, and pins held for loads.

- Writes: ``claim_writes`` gives a ``put_many`` the keys no other ``put_many`` is writing; they
  stay claimed until ``release_writes``.
- Stores: ``prepare_store`` hands each key to one caller only (not present at the top tier, not
  being stored or written by someone else) until ``complete_store``. A concurrent read of a key
  being stored misses; nothing here ever waits for a store.
- Loads: ``prepare_load`` pins keys in every tier that supports pins (``PinningTier``: host,
  lmdb), one ``pin_each`` call per tier for the batch, and counts each pin per (tier, key) so
  that ``complete_load`` undoes exactly the pins it took (one ``unpin`` call per tier).

Thread-safe: one lock guards the sets and counts; tier calls are made outside it, through
``GuardedTiers.call`` (a tier failure pins or finds nothing, never raises). Torch-free.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from cachestore.guarded_tiers import GuardedTiers
from cachestore.store_types import PinningTier
from tiers.base import Value


@dataclass(frozen=True, slots=True)
class PinCounts:
    in_flight_stores: int  # keys claimed by ``prepare_store`` or inside a ``put_many``
    load_pins: int  # pins taken by ``prepare_load`` and not yet undone, over all tiers


class StorePins:
    def __init__(self, tiers: GuardedTiers) -> None:
        self._tiers = tiers
        self._lock = threading.Lock()
        self._storing: set[str] = set()  # handed out by prepare_store
        self._writing: set[str] = set()  # inside a put_many
        self._load_pins: Counter[tuple[int, str]] = Counter()

    def claim_writes(self, items: Sequence[tuple[str, Value]]) -> list[tuple[str, Value]]:
        """The items whose keys nobody is writing (the first of repeats), now claimed by the
        caller: balance with ``release_writes`` of what this returned."""
        with self._lock:
            mine: list[tuple[str, Value]] = []
            for key, value in items:
                if key not in self._writing:
                    self._writing.add(key)
                    mine.append((key, value))
        return mine

    def release_writes(self, items: Sequence[tuple[str, Value]]) -> None:
        """Release the keys of ``claim_writes``'s answer."""
        with self._lock:
            self._writing.difference_update(k for k, _ in items)

    def prepare_store(self, keys: Sequence[str]) -> list[str]:
        """The keys this caller should store: not at the top tier and not being stored or
        written by someone else. They stay reserved until ``complete_store``."""
        with self._lock:
            fresh = [k for k in dict.fromkeys(keys) if k not in self._storing
                     and k not in self._writing]
            self._storing.update(fresh)
        present = {k for k in fresh if self._tiers.call(0, lambda t, k=k: t.contains(k), False)}
        if present:
            with self._lock:
                self._storing.difference_update(present)
        return [k for k in fresh if k not in present]

    def complete_store(self, keys: Sequence[str]) -> None:
        """Release keys from ``prepare_store``."""
        with self._lock:
            self._storing.difference_update(keys)

    def prepare_load(self, keys: Sequence[str]) -> int:
        """Pin each key in every pin-capable tier holding it (one ``pin_each`` call per tier);
        return how many leading keys are pinned somewhere. Balance with ``complete_load(keys)``.
        A failed tier pins nothing."""
        pinned_somewhere = [False] * len(keys)
        for i, tier in enumerate(self._tiers.tiers):
            if not keys or not isinstance(tier, PinningTier):
                continue
            flags = self._tiers.call(i, lambda t: t.pin_each(keys), None)  # type: ignore[attr-defined]
            if flags is None:
                continue
            with self._lock:
                for j, (key, pinned) in enumerate(zip(keys, flags, strict=True)):
                    if pinned:
                        pinned_somewhere[j] = True
                        self._load_pins[(i, key)] += 1
        return next((j for j, p in enumerate(pinned_somewhere) if not p), len(keys))

    def complete_load(self, keys: Sequence[str]) -> None:
        """Undo ``prepare_load``'s pins for ``keys`` (one ``unpin`` call per tier); keys
        without a pin of ``prepare_load`` are ignored."""
        unpin: list[list[str]] = [[] for _ in self._tiers.tiers]
        with self._lock:
            for key in keys:
                for i in range(len(self._tiers)):
                    if self._load_pins[(i, key)] == 0:  # a Counter reads 0 without inserting
                        continue
                    self._load_pins[(i, key)] -= 1
                    if self._load_pins[(i, key)] == 0:
                        del self._load_pins[(i, key)]
                    unpin[i].append(key)
        for i, mine in enumerate(unpin):
            if mine:
                self._tiers.call(i, lambda t, m=mine: t.unpin(m), None)  # type: ignore[attr-defined]

    def counts(self) -> PinCounts:
        """A consistent snapshot of the in-flight keys and the load pins."""
        with self._lock:
            return PinCounts(len(self._storing | self._writing), sum(self._load_pins.values()))
