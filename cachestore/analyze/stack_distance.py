"""LRU stack distances (Mattson et al., 1970) and the exact LRU hit curve in one pass.

The stack distance ``d`` of a block reference is 1 + the number of distinct blocks touched
since that block's previous reference and before its request arrived: an LRU cache of ``C``
blocks holds it at lookup time iff ``d <= C`` (LRU is a stack algorithm: a cache of ``C``
blocks always holds the ``C`` most recently touched ones). First references have ``d = inf``
(``COLD`` here). A request's leading hit in an LRU cache of ``C`` blocks is the number of
leading blocks whose running maximum of ``d`` is ``<= C``, so one histogram of those running
maxima gives the hit ratio at every capacity at once.

Two exact ways to compute ``d``:
- ``_chained_distances``: vectorized (numpy), O(N log N), for traces whose block ids are chained
  (equal id implies equal depth and equal parent, as in Mooncake traces and kvtier's hashes).
  There a block last touched in request ``r`` at depth ``i`` sees, since then, the rest of
  request ``r`` after depth ``i`` (all distinct, never touched again without touching the
  block itself) plus the distinct blocks of requests ``r+1 .. cur-1``.
- ``_fenwick_distances``: the textbook pass, a Fenwick tree over touch times (pure Python),
  for any trace.

Pure functions over a ``Trace``; nothing is mutated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cachestore.analyze.traces import Trace

COLD = np.iinfo(np.int64).max // 4


@dataclass(frozen=True, slots=True)
class StackDistances:
    """Per block reference: ``distance`` at lookup (``COLD`` for a first reference),
    ``prefix_max``, its running maximum over the request's blocks up to and including it, and
    ``touch_distance``, the classic Mattson depth when the block is touched (after the earlier
    blocks of its own request were), which drives tier-to-tier movements."""

    distance: np.ndarray
    prefix_max: np.ndarray
    touch_distance: np.ndarray
    chained: bool  # which algorithm produced them (both are exact)


@dataclass(frozen=True, slots=True)
class HitCurve:
    """Leading-hit blocks and tokens of an LRU cache at each capacity (in blocks)."""

    capacities_blocks: np.ndarray
    hit_blocks: np.ndarray
    hit_tokens: np.ndarray
    total_blocks: int
    total_tokens: int

    @property
    def block_hit_ratio(self) -> np.ndarray:
        return self.hit_blocks / max(self.total_blocks, 1)

    @property
    def token_hit_ratio(self) -> np.ndarray:
        return self.hit_tokens / max(self.total_tokens, 1)


def previous_reference(ids: np.ndarray) -> np.ndarray:
    """Index of the previous reference of the same block, -1 for a first reference."""
    order = np.argsort(ids, kind="stable")
    same = ids[order[1:]] == ids[order[:-1]]
    prev = np.full(len(ids), -1, np.int64)
    prev[order[1:][same]] = order[:-1][same]
    return prev


def _count_below(
    px: np.ndarray, py: np.ndarray, pw: np.ndarray, qx: np.ndarray, qy: np.ndarray
) -> np.ndarray:
    """For each query, the total weight of points with ``px <= qx`` and ``py < qy``.

    A merge-sort tree over the points in ``px`` order: at level ``l`` each run of ``2**l``
    points is sorted by ``py`` with prefix sums of weights, and a query's prefix of points is
    split into at most one run per level. O((P + Q) log P), all in numpy.
    """
    order = np.argsort(px, kind="stable")
    px, py, pw = px[order], py[order].astype(np.int64), pw[order]
    k = np.searchsorted(px, qx, side="right")  # the queries' prefixes of points
    total = np.zeros(len(qx), np.int64)
    pos = np.arange(len(px), dtype=np.int64)
    qy = qy.astype(np.int64)
    level = 0
    while (1 << level) <= len(px):
        block = pos >> level
        keys = (block << 32) | py
        o = np.argsort(keys, kind="stable")
        keys_sorted = keys[o]
        cw = np.zeros(len(px) + 1, np.int64)
        np.cumsum(pw[o], out=cw[1:])
        use = ((k >> level) & 1).astype(bool)
        b = (k[use] >> level) - 1
        hi = np.searchsorted(keys_sorted, (b << 32) | qy[use], side="left")
        total[use] += cw[hi] - cw[b << level]
        level += 1
    return total


def _chained_distances(trace: Trace, prev: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(lookup, touch) distances via request-level distinct counts; None when not chained."""
    ids, offsets = trace.block_ids, trace.offsets
    lens = np.diff(offsets)
    num_req = len(lens)
    req = np.repeat(np.arange(num_req, dtype=np.int64), lens)
    depth = np.arange(len(ids), dtype=np.int64) - offsets[req]
    reuse = np.flatnonzero(prev >= 0)
    p = prev[reuse]
    if np.any(depth[p] != depth[reuse]):
        return None
    deep = depth[reuse] > 0
    if np.any(ids[p[deep] - 1] != ids[reuse[deep] - 1]):
        return None
    cur, last = req[reuse], req[p]
    # Distinct blocks of requests [a, b] = first-seen blocks there + blocks seen before a and
    # touched again in [a, b] = (cold[b+1] - cold[a]) + #{reuse e: a <= req(e) <= b,
    # req(prev(e)) < a}; reuses with req(e) < a have req(prev(e)) < a by construction.
    cold_per_req = np.bincount(req[prev < 0], minlength=num_req)
    cold = np.zeros(num_req + 1, np.int64)
    np.cumsum(cold_per_req, out=cold[1:])
    reuses_before = np.zeros(num_req + 1, np.int64)
    np.cumsum(np.bincount(cur, minlength=num_req), out=reuses_before[1:])
    # Aggregate reuse events by (request, request of previous touch): few distinct pairs.
    pair = cur * num_req + last
    uniq, inverse, weight = np.unique(pair, return_inverse=True, return_counts=True)
    ucur, ulast = uniq // num_req, uniq % num_req
    a, b = ulast + 1, ucur - 1
    crossing = _count_below(ucur, ulast, weight, b, a) - reuses_before[a]
    between = cold[b + 1] - cold[a] + crossing
    tail = offsets[last + 1] - 1 - p  # the rest of the request that last touched the block
    dist = np.full(len(ids), COLD, np.int64)
    dist[reuse] = between[inverse.reshape(-1)] + tail + 1
    # At touch time the earlier blocks of the request that were last touched in the same
    # request as this one (a contiguous run just before it: the request-of-last-touch never
    # increases along a chain) have moved above it; those touched later were above already.
    run_start = np.ones(len(reuse), bool)
    run_start[1:] = (reuse[1:] != reuse[:-1] + 1) | (last[1:] != last[:-1])
    starts = np.maximum.accumulate(np.where(run_start, np.arange(len(reuse)), 0))
    touch = np.full(len(ids), COLD, np.int64)
    touch[reuse] = dist[reuse] + np.arange(len(reuse)) - starts
    return dist, touch


def _fenwick_distances(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """The textbook pass: a Fenwick tree marks each block's latest touch time. O(N log N).

    Returns (lookup, touch) distances."""
    ids = trace.block_ids.tolist()
    offsets = trace.offsets.tolist()
    n = len(ids)
    tree = [0] * (n + 1)
    last: dict[int, int] = {}
    dist = [COLD] * n
    touch = [COLD] * n

    def add(i: int, v: int) -> None:
        i += 1
        while i <= n:
            tree[i] += v
            i += i & -i

    def prefix(i: int) -> int:  # marks at times < i
        s = 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    for r in range(len(offsets) - 1):
        start, end = offsets[r], offsets[r + 1]
        before = prefix(start)
        for j in range(start, end):
            p = last.get(ids[j])
            if p is not None:
                dist[j] = before - prefix(p + 1) + 1
        for j in range(start, end):
            p = last.get(ids[j])
            if p is not None:
                touch[j] = prefix(j) - prefix(p + 1) + 1
                add(p, -1)
            add(j, 1)
            last[ids[j]] = j
    return np.asarray(dist, np.int64), np.asarray(touch, np.int64)


def stack_distances(trace: Trace, force_fenwick: bool = False) -> StackDistances:
    """Exact LRU stack distance of every block reference (see the module docstring)."""
    both = None
    if not force_fenwick and trace.num_block_refs:
        prev = previous_reference(trace.block_ids)
        both = _chained_distances(trace, prev)
    chained = both is not None
    dist, touch = _fenwick_distances(trace) if both is None else both
    lens = np.diff(trace.offsets)
    req = np.repeat(np.arange(len(lens), dtype=np.int64), lens)
    # Running max within each request in one numpy call: shift every request above all earlier
    # ones. COLD would overflow that encoding, so cap distances at references + 1 first (no
    # finite distance reaches it).
    clip = len(dist) + 1
    capped = np.minimum(dist, clip)
    enc = req * (clip + 1) + capped
    pmax = np.maximum.accumulate(enc) - req * (clip + 1) if len(enc) else enc
    pmax = np.where(pmax >= clip, COLD, pmax)
    return StackDistances(distance=dist, prefix_max=pmax, touch_distance=touch, chained=chained)


def lru_hit_curve(
    trace: Trace, capacities_blocks: np.ndarray | list[int], distances: StackDistances | None = None
) -> HitCurve:
    """Exact leading-hit blocks and tokens of one LRU cache at every capacity, in one pass."""
    sd = stack_distances(trace) if distances is None else distances
    caps = np.asarray(capacities_blocks, dtype=np.int64)
    if np.any(caps < 0):
        raise ValueError("capacities must be >= 0 blocks")
    warm = sd.prefix_max != COLD
    m = sd.prefix_max[warm]
    tokens = trace.block_token_counts()[warm]
    top = int(m.max()) + 1 if len(m) else 1
    by_blocks = np.zeros(top + 1, np.int64)
    np.cumsum(np.bincount(m, minlength=top), out=by_blocks[1:])
    by_tokens = np.zeros(top + 1, np.int64)
    np.cumsum(np.bincount(m, weights=tokens, minlength=top).astype(np.int64), out=by_tokens[1:])
    idx = np.minimum(caps + 1, top)  # by_*[i] counts running maxima < i; a hit needs <= C
    return HitCurve(
        caps, by_blocks[idx], by_tokens[idx], trace.num_block_refs, int(trace.input_tokens.sum())
    )
