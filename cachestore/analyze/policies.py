"""Eviction policies for one simulated tier: LRU, LFU and a recompute-cost-aware one.

Every policy holds a set of block ids and answers which one to evict. The simulator calls
``insert`` for a block that is not in the tier, ``touch`` for one that is, ``remove`` when a
block is promoted out of the tier, and ``pop_victim`` when the tier is over capacity. ``value``
is the simulator's per-block hint: the block's reference count so far for LFU, the prefill
seconds its reload saves per byte for the cost-aware policy; LRU ignores it.

Not thread-safe (one simulation, one thread). ``pop_victim`` on an empty tier raises KeyError.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol


class Policy(Protocol):
    name: str

    def __len__(self) -> int: ...
    def __contains__(self, block: int) -> bool: ...
    def insert(self, block: int, value: float) -> None:
        """Add an absent block. Mutates."""

    def touch(self, block: int, value: float) -> None:
        """Refresh a present block. Mutates."""

    def remove(self, block: int) -> None:
        """Drop a present block without counting an eviction. Mutates."""

    def pop_victim(self) -> int:
        """Remove and return the block to evict. Mutates; KeyError when empty."""


class LRUPolicy:
    """Least recently used: an OrderedDict whose front is the victim."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block: int) -> bool:
        return block in self._order

    def insert(self, block: int, value: float) -> None:
        self._order[block] = None

    def touch(self, block: int, value: float) -> None:
        self._order.move_to_end(block)

    def remove(self, block: int) -> None:
        del self._order[block]

    def pop_victim(self) -> int:
        return self._order.popitem(last=False)[0]


class _HeapPolicy:
    """Evicts the block of least priority; ties go to the least recently refreshed.

    A binary heap with lazy invalidation: every refresh pushes a new entry and the stale ones
    are skipped when they surface. O(log n) per operation, amortized.
    """

    name = "heap"

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int]] = []
        self._live: dict[int, int] = {}  # block -> sequence number of its live heap entry
        self._seq = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, block: int) -> bool:
        return block in self._live

    def _priority(self, value: float) -> float:
        raise NotImplementedError

    def _push(self, block: int, value: float) -> None:
        self._seq += 1
        self._live[block] = self._seq
        heapq.heappush(self._heap, (self._priority(value), self._seq, block))
        if len(self._heap) > 4 * len(self._live) + 64:  # keep stale entries bounded
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def insert(self, block: int, value: float) -> None:
        self._push(block, value)

    def touch(self, block: int, value: float) -> None:
        self._push(block, value)

    def remove(self, block: int) -> None:
        del self._live[block]

    def pop_victim(self) -> int:
        while True:
            prio, seq, block = heapq.heappop(self._heap)
            if self._live.get(block) == seq:
                del self._live[block]
                self._on_evict(prio)
                return block

    def _on_evict(self, priority: float) -> None:
        pass


class LFUPolicy(_HeapPolicy):
    """Least frequently used; ``value`` is the block's reference count (kept across tiers)."""

    name = "lfu"

    def _priority(self, value: float) -> float:
        return value


class CostAwarePolicy(_HeapPolicy):
    """GreedyDual-Size with the cost model: priority = L + (prefill seconds saved per byte).

    ``L`` rises to each victim's priority, so blocks that are not refreshed age out while the
    ones whose recompute is expensive (deep in long prompts: attention grows with context) stay
    longer. This is the trade Marconi (arXiv 2411.19379) makes with FLOPs saved per byte plus
    recency; GreedyDual folds the recency into ``L``.
    """

    name = "cost"

    def __init__(self) -> None:
        super().__init__()
        self._inflation = 0.0

    def _priority(self, value: float) -> float:
        return self._inflation + value

    def _on_evict(self, priority: float) -> None:
        self._inflation = priority


POLICIES: dict[str, Callable[[], Policy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "cost": CostAwarePolicy,
}


def make_policy(name: str) -> Policy:
    """A fresh, empty policy by name. Raises ValueError for an unknown one."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
