"""Multi-tier replay of a trace against tier capacities and eviction policies.

The simulation (docs/analyze.md pins it; tests check it):
1. Requests are taken in timestamp order (stable).
2. Lookup: a request's hit is its number of leading blocks found anywhere in the hierarchy,
   each credited to the tier that holds it. The lookup changes nothing.
3. Touch: then every block of the request, in order, is touched. A block found in the top tier
   is refreshed there; a block found in a lower tier is promoted (removed there, inserted at
   the top, as a reload brings it up to the GPU); a missing block is inserted at the top.
4. A tier over capacity evicts one block by its policy and demotes it into the next tier
   (which may then evict in turn); the last tier drops it. Each block lives in one tier.

With LRU in every tier, the hierarchy behaves as one LRU cache of the summed capacity whose
most recent blocks sit in the top tier: hits are conserved, and stack_distance.py computes the
same numbers without a replay.

Pure computation over a ``Trace``; the optional progress callback is the only side effect.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cachestore.analyze.policies import make_policy
from cachestore.analyze.stack_distance import COLD, StackDistances
from cachestore.analyze.traces import Trace


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One simulated tier; ``capacity_blocks`` None means unbounded."""

    name: str
    capacity_blocks: int | None
    policy: str = "lru"

    def __post_init__(self) -> None:
        if self.capacity_blocks is not None and self.capacity_blocks < 0:
            raise ValueError(f"tier {self.name!r}: capacity must be >= 0 blocks")


@dataclass(frozen=True, slots=True)
class TierCounts:
    """What one tier did over the replay, in blocks."""

    name: str
    capacity_blocks: int | None
    policy: str
    hit_blocks: int  # leading hits this tier served
    inserted_blocks: int  # written into it: new or promoted (top tier) or demoted (lower ones)
    evicted_blocks: int  # pushed out of it (demoted below, or dropped from the last tier)
    resident_blocks: int  # held at the end


@dataclass(frozen=True, slots=True)
class ReplayResult:
    hit_blocks: np.ndarray  # per request: leading blocks found
    tier_hit_blocks: np.ndarray  # (requests, tiers): of those, how many each tier served
    tiers: tuple[TierCounts, ...]


ProgressFn = Callable[[int], object]  # its return value is ignored (tqdm.update returns one)


def replay(
    trace: Trace,
    tiers: Sequence[TierSpec],
    value_per_byte_by_depth: Sequence[float] | None = None,
    progress: ProgressFn | None = None,
    progress_every: int = 1024,
) -> ReplayResult:
    """Replay ``trace`` through ``tiers`` (top first). Raises ValueError on a bad setup.

    ``value_per_byte_by_depth[i]`` (needed by the ``cost`` policy) is the prefill time saved
    per byte by holding a block at depth ``i``. ``progress(n)`` is called with the number of
    requests done since the last call.
    """
    if not tiers:
        raise ValueError("need at least one tier")
    hierarchy = _Hierarchy(tiers, value_per_byte_by_depth)
    ids = trace.block_ids.tolist()
    offsets = trace.offsets.tolist()
    num_req = trace.num_requests
    hits = [0] * num_req
    served: list[int] = []  # per leading hit, in order: the serving tier
    for r in range(num_req):
        start, end = offsets[r], offsets[r + 1]
        hits[r] = hierarchy.lookup(ids, start, end, served)
        hierarchy.touch(ids, start, end)
        if progress is not None and (r + 1) % progress_every == 0:
            progress(progress_every)
    if progress is not None and num_req % progress_every:
        progress(num_req % progress_every)
    return hierarchy.result(hits, served)


class _Hierarchy:
    """The simulated tiers during a replay: which tier holds each block, each tier's policy
    and counters. ``lookup`` and ``touch`` are steps 2 and 3-4 of the module docstring."""

    __slots__ = (
        "tiers",
        "pols",
        "caps",
        "kinds",
        "vpb",
        "plain",
        "loc",
        "refs",
        "depth_of",
        "inserted",
        "evicted",
        "value",
    )

    def __init__(self, tiers: Sequence[TierSpec], vpb: Sequence[float] | None) -> None:
        self.tiers = tiers
        self.pols = [make_policy(t.policy) for t in tiers]
        self.caps = [math.inf if t.capacity_blocks is None else t.capacity_blocks for t in tiers]
        use_counts = any(t.policy == "lfu" for t in tiers)
        use_cost = any(t.policy == "cost" for t in tiers)
        if use_cost and vpb is None:
            raise ValueError("the cost policy needs value_per_byte_by_depth")
        self.vpb = list(vpb or [])
        self.kinds = [t.policy for t in tiers]
        self.plain = not (use_counts or use_cost)  # no policy needs a block's value
        self.loc: dict[int, int] = {}  # block -> index of the tier that holds it
        self.refs: dict[int, int] = {}  # block -> references so far (LFU)
        self.depth_of: dict[int, int] = {}  # block -> depth at its last reference (cost)
        self.inserted = [0] * len(tiers)
        self.evicted = [0] * len(tiers)
        self.value = _value_of(self.kinds, self.refs, self.depth_of, self.vpb)

    def lookup(self, ids: list[int], start: int, end: int, served: list[int]) -> int:
        """The leading blocks of ``ids[start:end]`` held anywhere; their tiers go to
        ``served``. Changes nothing else."""
        loc = self.loc
        h = 0
        for j in range(start, end):
            t = loc.get(ids[j])
            if t is None:
                break
            served.append(t)
            h += 1
        return h

    def touch(self, ids: list[int], start: int, end: int) -> None:
        """Refresh, promote or insert each block of ``ids[start:end]`` at the top, in order,
        each overflow cascading one victim down per level (module docstring, steps 3-4)."""
        # Locals: this loop runs once per block reference of the trace.
        loc, pols, plain, refs, depth_of = self.loc, self.pols, self.plain, self.refs, self.depth_of
        caps, value, inserted, evicted = self.caps, self.value, self.inserted, self.evicted
        top, cap0, num_tiers = pols[0], caps[0], len(pols)
        for j in range(start, end):
            b = ids[j]
            if not plain:
                refs[b] = refs.get(b, 0) + 1
                depth_of[b] = j - start
            t = loc.get(b)
            v0 = 0.0 if plain else value(0, b)
            if t == 0:
                top.touch(b, v0)
                continue
            if t is not None:
                pols[t].remove(b)
            top.insert(b, v0)
            loc[b] = 0
            inserted[0] += 1
            if len(top) <= cap0:
                continue
            i = 0  # over capacity: cascade one victim down per level, the last tier drops it
            while len(pols[i]) > caps[i]:
                victim = pols[i].pop_victim()
                evicted[i] += 1
                if i + 1 == num_tiers:
                    del loc[victim]
                    break
                i += 1
                pols[i].insert(victim, 0.0 if plain else value(i, victim))
                loc[victim] = i
                inserted[i] += 1

    def result(self, hits: list[int], served: list[int]) -> ReplayResult:
        """Per-request hits, per-request hits by tier, and each tier's counts."""
        num_req, num_tiers = len(hits), len(self.tiers)
        hits_arr = np.asarray(hits, np.int64)
        req_of_hit = np.repeat(np.arange(num_req, dtype=np.int64), hits_arr)
        flat = req_of_hit * num_tiers + np.asarray(served, np.int64)
        tier_hits = np.bincount(flat, minlength=num_req * num_tiers).reshape(num_req, num_tiers)
        per_tier_hits = tier_hits.sum(axis=0)
        counts = tuple(
            TierCounts(
                t.name,
                t.capacity_blocks,
                t.policy,
                int(per_tier_hits[i]),
                self.inserted[i],
                self.evicted[i],
                len(self.pols[i]),
            )
            for i, t in enumerate(self.tiers)
        )
        return ReplayResult(hits_arr, tier_hits, counts)


def _value_of(
    kinds: list[str], refs: dict[int, int], depth_of: dict[int, int], vpb: list[float]
) -> Callable[[int, int], float]:
    """``value(tier, block)``: what ``tier``'s policy keeps ``block`` by: its references (LFU)
    or the prefill time per byte its depth saves (cost); 0 for the others. A closure over the
    replay's state, not a method: it runs once per touched block of an LFU or cost tier."""

    def value(tier: int, block: int) -> float:
        if kinds[tier] == "lfu":
            return float(refs[block])
        if kinds[tier] == "cost":
            d = depth_of[block]
            return vpb[d] if d < len(vpb) else vpb[-1]
        return 0.0

    return value


def lru_hierarchy(
    trace: Trace, distances: StackDistances, tiers: Sequence[TierSpec]
) -> ReplayResult:
    """The result ``replay`` gives for an all-LRU hierarchy, from stack distances, vectorized.

    The global LRU stack splits by depth: the top tier holds the ``C0`` most recent blocks, the
    next the following ``C1``, and so on. A touch at depth ``d`` (or of a new block) shifts the
    blocks above it down by one, so the block at the bottom of tier ``i`` moves down a tier
    exactly when ``d > B_i`` (``B_i = C0 + ... + Ci``) and the stack already holds ``B_i``
    blocks. Raises ValueError when a tier is not LRU.
    """
    if any(t.policy != "lru" for t in tiers):
        raise ValueError("lru_hierarchy needs LRU in every tier; use replay()")
    unbounded = np.iinfo(np.int64).max // 8
    caps = [unbounded if t.capacity_blocks is None else t.capacity_blocks for t in tiers]
    bounds = np.cumsum(caps)
    bounds = np.minimum(bounds, unbounded)
    num_req, num_tiers = trace.num_requests, len(tiers)
    lens = np.diff(trace.offsets)
    req = np.repeat(np.arange(num_req, dtype=np.int64), lens)
    hit = distances.prefix_max <= bounds[-1]
    tier_of_hit = np.searchsorted(bounds, distances.distance[hit], side="left")
    flat = req[hit] * num_tiers + tier_of_hit
    tier_hits = np.bincount(flat, minlength=num_req * num_tiers).reshape(num_req, num_tiers)
    touch = distances.touch_distance
    new = touch == COLD
    size_before = np.cumsum(new) - new  # distinct blocks already in the stack
    evicted = [int(np.count_nonzero((touch > b) & (size_before >= b))) for b in bounds]
    inserted = [int(np.count_nonzero(touch > bounds[0]))] + evicted[:-1]
    final = trace.num_unique_blocks
    above = [sum(caps[:i]) for i in range(num_tiers)]  # python ints: no overflow
    resident = [min(max(final - above[i], 0), caps[i]) for i in range(num_tiers)]
    per_tier = tier_hits.sum(axis=0)
    counts = tuple(
        TierCounts(
            t.name,
            t.capacity_blocks,
            t.policy,
            int(per_tier[i]),
            inserted[i],
            evicted[i],
            resident[i],
        )
        for i, t in enumerate(tiers)
    )
    return ReplayResult(tier_hits.sum(axis=1), tier_hits, counts)
