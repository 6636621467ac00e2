"""The hierarchical store's key bookkeeping: keys in flight, and pins held for loads.

- Writes: ``claim_writes`` gives a ``put_many`` the keys no other ``put_many`` is writing; they
  stay claimed until ``release_writes``.
- Stores: ``prepare_store`` hands each key to one caller only (not present at the top tier, not
  being stored or written by someone else) until ``complete_store``. A concurrent read of a key
  being stored misses; nothing here ever waits for a store.
- Load claims (for ``cachestore.store.loads``, which owns a load's pins and calls these):
  ``prepare_load`` pins keys in every tier that supports pins (``PinningTier``: host,
  lmdb), one ``pin_each`` call per tier for the batch; ``complete_load`` undoes them (one
  ``unpin`` call per tier). Callers are not told apart (no handle), so the accounting is per
  key: every ``prepare_load`` of a key is a *claim*, whether or not it pinned anything, and
  load pins on a (tier, key) never outnumber the key's open claims. ``complete_load`` drops
  one claim and unpins only what exceeds the claims left. Why not "unpin what is recorded":
  a caller whose ``prepare_load`` found the key absent (no pin) would then take the pin of a
  later caller that found it present, whose host-slab view could be evicted and its slot
  reused for another key while it was still copying it out.

Thread-safe: one lock guards the sets and counts; tier calls are made outside it, through
``GuardedTiers.call`` (a tier failure pins or finds nothing, never raises). Torch-free.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cachestore.store.guarded_tiers import GuardedTiers
from cachestore.store.types import PinningTier
from tiers.base import Tier, Value


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
        self._load_pins: Counter[tuple[int, str]] = Counter()  # pins held, per tier and key
        self._load_claims: Counter[str] = Counter()  # prepare_loads not yet completed, per key

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
            fresh = [
                k for k in dict.fromkeys(keys) if k not in self._storing and k not in self._writing
            ]
            self._storing.update(fresh)
        flags = self._tiers.call(0, _contains_many(fresh), None) if fresh else []
        present = {k for k, here in zip(fresh, flags or [], strict=False) if here}
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
        return how many leading keys are pinned somewhere. Balance with ``complete_load(keys)``
        (the same keys, repeats included). A failed tier pins nothing."""
        with self._lock:  # claims first: a pin is never recorded without its claim
            self._load_claims.update(keys)
        pinned_somewhere = [False] * len(keys)
        for i, tier in enumerate(self._tiers.tiers):
            if not keys or not isinstance(tier, PinningTier):
                continue
            flags = self._tiers.call(i, _pin_each(keys), None)
            if flags is None:
                continue
            with self._lock:
                for j, (key, pinned) in enumerate(zip(keys, flags, strict=True)):
                    if pinned:
                        pinned_somewhere[j] = True
                        self._load_pins[(i, key)] += 1
        return next((j for j, p in enumerate(pinned_somewhere) if not p), len(keys))

    def complete_load(self, keys: Sequence[str]) -> None:
        """Close one ``prepare_load`` claim per key and unpin, per tier, the load pins beyond
        the key's remaining claims (one ``unpin`` call per tier). So the pins of a caller
        still loading a key stay, whichever caller completes first. Keys without an open
        claim are ignored."""
        unpin: list[list[str]] = [[] for _ in self._tiers.tiers]
        with self._lock:
            for key in keys:
                if self._load_claims[key] == 0:  # a Counter reads 0 without inserting
                    continue
                self._load_claims[key] -= 1
                left = self._load_claims[key]
                if left == 0:
                    del self._load_claims[key]
                for i in range(len(self._tiers)):
                    while self._load_pins[(i, key)] > left:
                        self._load_pins[(i, key)] -= 1
                        unpin[i].append(key)
                    if self._load_pins[(i, key)] == 0:
                        del self._load_pins[(i, key)]
        for i, mine in enumerate(unpin):
            if mine:
                self._tiers.call(i, _unpin(mine), None)

    def counts(self) -> PinCounts:
        """A consistent snapshot of the in-flight keys and the load pins."""
        with self._lock:
            return PinCounts(len(self._storing | self._writing), sum(self._load_pins.values()))


# A tier call's function per key list, built outside the caller's loop (the loop variable is
# bound here, once per call).
def _contains_many(keys: Sequence[str]) -> Callable[[Tier], list[bool]]:
    return lambda tier: tier.contains_many(keys)


def _pin_each(keys: Sequence[str]) -> Callable[[Tier], list[bool] | None]:
    return lambda tier: tier.pin_each(keys) if isinstance(tier, PinningTier) else None


def _unpin(keys: Sequence[str]) -> Callable[[Tier], None]:
    return lambda tier: tier.unpin(keys) if isinstance(tier, PinningTier) else None
