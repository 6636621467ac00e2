"""The hierarchical store's reads: top tier first, each tier asked only for what the tiers
above it missed, every value checked by the codec before it counts.

- ``read``: values as the tiers return them (encoded) or their decoded payloads; what
  ``HierarchicalStore.get_many``/``get_many_encoded``/``get_many_pinned`` answer.
- ``lookup_chain``: which tier serves each leading block; ``HierarchicalStore.lookup``.
- ``read_pinned``: ``read`` with each host-tier hit pinned for the caller first;
  ``HierarchicalStore.get_many_pinned``.
- ``read_into``: each hit copied by its tier straight into a buffer the caller owns
  (``Tier.get_many_into``) and checked there; ``HierarchicalStore.get_many_into``.

Both: a value that fails the codec (checksum, namespace, the key it was read under) is a miss
of that tier, counted ``corrupt`` (``wrong_key`` too) and deleted from it; the next tier is
asked. A tier failure is a miss (``GuardedTiers.call``). Hits below the top are queued for
promotion into the top tier (``promote``, asynchronous, never blocking). Hits are reported to
the selective write-through (``hit``).

What promotion holds: the queue keeps each value until the top tier's put copies it. A value
is queued as it is where it stays valid while held (``bytes``; a view from a tier with
``owns_read_values``, whose recycled buffer, ``tiers.buffers``, is not reused while a view of
it lives); a view that may die at the tier's next call (the remote tier) is copied to
``bytes`` first. ``read_into`` cannot queue the caller's buffers (the caller reuses them as
soon as the call returns): it copies each promoted block once, into one recycled buffer of its
own, which returns to its pool once the top tier wrote the batch.

Thread-safe (each call works on its own lists; stats and tiers lock themselves). Torch-free.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from cachestore.codec import CodecError, DecodedBlock, block_key_of, decode_block
from cachestore.store.guarded_tiers import GuardedTiers
from cachestore.store.host import HostFastPath
from cachestore.store.inflight import InFlight
from cachestore.store.types import LookupResult, StoreConfig, TierLookup
from tiers.base import Tier, Value, writable_views
from tiers.buffers import ReadBuffers, copy_into

log = logging.getLogger(__name__)
_SKIP: Any = object()  # a tier call that did not happen or failed
_PROMOTE_IDLE_BYTES = 256 << 20  # idle promotion copy buffers kept (one batch of 2 MiB blocks)

Promote = Callable[[list[tuple[str, Value]]], None]


def owned_value(tier: Tier, value: Value) -> Value:
    """``value`` itself where it stays valid for as long as it is held (``bytes``, or a view
    from a tier that ``owns_read_values``), else a ``bytes`` copy."""
    if isinstance(value, bytes) or getattr(tier, "owns_read_values", False):
        return value
    return bytes(value)


class StoreReads:
    def __init__(
        self,
        tiers: GuardedTiers,
        host: HostFastPath,
        config: Callable[[], StoreConfig],
        promote: Promote,
        hit: Callable[[list[str]], None],
        inflight: InFlight,
    ) -> None:
        """``config()``: the store's current config (namespace, key scope, promote_on_get);
        ``promote(items)``: queue (key, encoded block) pairs for the top tier, never blocking;
        ``hit(keys)``: the selective write-through's hit count; ``inflight``: blocks queued for
        a tier and not yet written, read as that tier's (``cachestore.store.inflight``)."""
        self._tiers = tiers
        self._inflight = inflight
        self._host = host
        self._config = config
        self._promote = promote
        self._hit = hit
        self._copies = ReadBuffers(max_idle_bytes=_PROMOTE_IDLE_BYTES)

    def read(
        self,
        keys: Sequence[str],
        decoded: bool,
        promote_hits: bool = True,
        first_tier: int = 0,
        count_hits: bool = True,
        owned: bool = False,
    ) -> list[Value | None]:
        """Encoded blocks (``decoded``: their payloads), ``None`` = miss. ``owned``: every
        encoded value stays valid while held (``owned_value``), for callers that keep them
        past another tier call. Never raises for tier failures."""
        config = self._config()
        tiers = self._tiers.tiers
        out: list[Value | None] = [None] * len(keys)
        remaining = list(range(len(keys)))
        promote: list[tuple[str, Value]] = []
        promoting = promote_hits and config.promote_on_get
        for i in range(first_tier, len(tiers)):
            if not remaining:
                break
            wanted = [keys[j] for j in remaining]
            t0 = time.perf_counter()
            values = self._tiers.call(i, _get_many(wanted), _SKIP)
            skipped = values is _SKIP
            values = self._with_inflight(i, wanted, [] if skipped else values)
            if skipped and not any(v is not None for v in values):
                continue  # the tier backs off and nothing is on its way to it
            seconds = time.perf_counter() - t0
            still, corrupt, nbytes, wrong_key = [], [], 0, 0
            for j, value in zip(remaining, values, strict=False):  # a tier's answer
                if value is None:
                    still.append(j)
                    continue
                nbytes += len(value)
                block = _check(tiers[i], value, keys[j], config)
                if isinstance(block, CodecError):
                    corrupt.append(keys[j])
                    wrong_key += block.reason == "wrong_key"
                    still.append(j)
                    continue
                keep = value
                if owned or (i > 0 and promoting):
                    keep = owned_value(tiers[i], value)
                    if i > 0 and promoting:
                        promote.append((keys[j], keep))
                out[j] = block.payload if decoded else keep
            still += remaining[len(values) :]  # a short answer: the rest are misses here
            self._account(
                i, len(remaining) - len(still), len(still), nbytes, seconds, len(corrupt), wrong_key
            )
            self._delete(i, corrupt)
            remaining = still
        if promote:
            self._promote(promote)
        if count_hits:
            self._hit([k for k, v in zip(keys, out, strict=True) if v is not None])
        return out

    def read_pinned(
        self, keys: Sequence[str], decoded: bool
    ) -> tuple[list[Value | None], list[str]]:
        """``HierarchicalStore.get_many_pinned``: (values, the keys pinned in the host tier for
        this call). A key is read from the host tier only when pinned there first (one
        ``pin_each``); the others come from the lower tiers, owned, counted host misses."""
        if self._host.slab is None or not keys:
            return self.read(keys, decoded), []
        flags = self._host.pin(keys)
        mine = [j for j, f in enumerate(flags) if f]
        rest = [j for j, f in enumerate(flags) if not f]
        out: list[Value | None] = [None] * len(keys)
        if mine:
            for j, v in zip(mine, self.read([keys[j] for j in mine], decoded), strict=True):
                out[j] = v
        if rest:
            self._tiers.stats[0].add("misses", len(rest))
            for j, v in zip(
                rest, self.read([keys[j] for j in rest], decoded, first_tier=1), strict=True
            ):
                out[j] = v
        return out, [keys[j] for j in mine]

    def read_into(
        self,
        keys: Sequence[str],
        out: Sequence[Any],
        first_tier: int = 0,
        promote: bool = True,
    ) -> list[int | None]:
        """``HierarchicalStore.get_many_into`` (its docstring is the contract); from
        ``first_tier`` down (the host fast path's stage reads the tiers below it), hits from
        lower tiers promoted unless ``promote`` is False. Raises ValueError (one line) for bad
        buffers, before any tier is asked."""
        views = writable_views(keys, out)
        config = self._config()
        lengths: list[int | None] = [None] * len(keys)
        lower: list[int] = []  # indices whose verified block came from below the top
        remaining = list(range(len(keys)))
        first = first_tier
        if first_tier == 0 and self._host.slab is not None and keys:
            # A host value is copied out of the slab: only under a pin taken for this call,
            # so a concurrent put cannot reuse its slot in the middle of the copy.
            flags = self._host.pin(keys)
            mine = [j for j, f in enumerate(flags) if f]
            corrupt: list[str] = []
            try:
                still = self._tier_into(0, keys, views, mine, lengths, config, lower, corrupt)
            finally:
                self._host.unpin([keys[j] for j in mine])
            self._delete(0, corrupt)  # unpinned first: the host tier keeps pinned entries
            rest = [j for j, f in enumerate(flags) if not f]
            if rest:
                self._tiers.stats[0].add("misses", len(rest))
            remaining, first = sorted(still + rest), 1
        for i in range(first, len(self._tiers)):
            if not remaining:
                break
            corrupt = []
            remaining = self._tier_into(i, keys, views, remaining, lengths, config, lower, corrupt)
            self._delete(i, corrupt)
        if lower and promote and config.promote_on_get:
            self._promote(self._copy(keys, views, lengths, lower))
        hits = [keys[j] for j, n in enumerate(lengths) if n is not None and n <= views[j].nbytes]
        if hits:
            self._hit(hits)
        return lengths

    def _tier_into(
        self,
        i: int,
        keys: Sequence[str],
        views: list[memoryview],
        idx: list[int],
        lengths: list[int | None],
        config: StoreConfig,
        lower: list[int],
        corrupt: list[str],
    ) -> list[int]:
        """Read ``keys[idx]`` from tier i into their views and check them; set ``lengths`` of
        the hits and of values too large for their buffer; add the keys of corrupt values to
        ``corrupt`` (the caller deletes them); return the indices still missing."""
        if not idx:
            return idx
        wanted = [keys[j] for j in idx]
        bufs = [views[j] for j in idx]
        t0 = time.perf_counter()
        got = self._tiers.call(i, lambda t: t.get_many_into(wanted, bufs), _SKIP)
        skipped = got is _SKIP
        got = self._into_from_inflight(i, wanted, bufs, [] if skipped else got)
        if skipped and not any(n is not None for n in got):
            return idx  # the tier backs off and nothing is on its way to it
        seconds = time.perf_counter() - t0
        still, nbytes, wrong_key, too_big = [], 0, 0, 0
        for j, n in zip(idx, got, strict=False):
            if n is None:
                still.append(j)
            elif n > views[j].nbytes:  # not written: the caller sees the length, no lower tier
                lengths[j] = n
                too_big += 1
            else:
                nbytes += n
                block = _check(self._tiers.tiers[i], views[j][:n], keys[j], config)
                if isinstance(block, CodecError):
                    corrupt.append(keys[j])
                    wrong_key += block.reason == "wrong_key"
                    still.append(j)
                    continue
                lengths[j] = n
                if i > 0:
                    lower.append(j)
        still += idx[len(got) :]  # a short answer: the rest are misses here
        misses = len(still) + too_big
        self._account(i, len(idx) - misses, misses, nbytes, seconds, len(corrupt), wrong_key)
        return still

    def _with_inflight(
        self, i: int, keys: Sequence[str], values: Sequence[Value | None]
    ) -> list[Value | None]:
        """``values`` (tier i's answer) with its misses answered by the blocks queued for tier
        i (counted ``inflight_hits``); a short answer is padded with misses first."""
        out = list(values) + [None] * (len(keys) - len(values))
        if not self._inflight.count(i):
            return out
        found = 0
        for j, v in enumerate(out):
            if v is None:
                out[j] = self._inflight.get(i, keys[j])
                found += out[j] is not None
        if found:
            self._tiers.stats[i].add("inflight_hits", found)
        return out

    def _into_from_inflight(
        self, i: int, keys: Sequence[str], bufs: Sequence[memoryview], got: Sequence[int | None]
    ) -> list[int | None]:
        """``get_many_into``'s answer of tier i with its misses copied from the blocks queued
        for tier i, where they fit (a longer one reports its length, as a tier does)."""
        out = list(got) + [None] * (len(keys) - len(got))
        if not self._inflight.count(i):
            return out
        found = 0
        for j, n in enumerate(out):
            if n is not None:
                continue
            value = self._inflight.get(i, keys[j])
            if value is None:
                continue
            src = memoryview(value).cast("B")
            if src.nbytes <= bufs[j].nbytes:
                copy_into(bufs[j], src)
                found += 1
            out[j] = src.nbytes
        if found:
            self._tiers.stats[i].add("inflight_hits", found)
        return out

    def _copy(
        self,
        keys: Sequence[str],
        views: list[memoryview],
        lengths: list[int | None],
        idx: list[int],
    ) -> list[tuple[str, Value]]:
        """One copy of each block to promote, all in one recycled buffer (already faulted in;
        a fresh ``bytes`` per block page-faults on every page), held by the promotion queue."""
        dest = self._copies.take(sum(lengths[j] or 0 for j in idx))
        items: list[tuple[str, Value]] = []
        pos = 0
        for j in idx:
            end = pos + (lengths[j] or 0)
            dest[pos:end] = views[j][: end - pos]
            items.append((keys[j], dest[pos:end]))
            pos = end
        return items

    def _account(
        self,
        i: int,
        hits: int,
        misses: int,
        nbytes: int,
        seconds: float,
        corrupt: int,
        wrong_key: int,
    ) -> None:
        stats = self._tiers.stats[i]
        stats.record_read(hits, misses, nbytes, seconds)
        if wrong_key:
            stats.add("wrong_key", wrong_key)
        if corrupt:
            stats.add("corrupt", corrupt)

    def _delete(self, i: int, corrupt: list[str]) -> None:
        """Delete values the codec refused from tier i (they would fail every read)."""
        if corrupt:
            self._tiers.call(i, lambda t: t.delete_many(corrupt), 0)


def _check(tier: Tier, value: Value, key: str, config: StoreConfig) -> DecodedBlock | CodecError:
    """``value`` read under ``key``, decoded, or the codec's error (logged)."""
    try:
        return decode_block(
            value, config.namespace, expected_key=block_key_of(key, config.block_key_skip)
        )
    except CodecError as exc:
        log.warning("tier %s: corrupt block %s (%s)", tier.name, key, exc.reason)
        return exc


def _get_many(keys: Sequence[str]) -> Callable[[Tier], list[Value | None]]:
    """A tier call's function, built outside the caller's loop."""
    return lambda tier: tier.get_many(keys)


def lookup_chain(tiers: GuardedTiers, keys: Sequence[str], inflight: InFlight) -> LookupResult:
    """``HierarchicalStore.lookup``: which tier serves each block of the longest prefix of
    ``keys`` the tiers hold, each tier asked only from the first block the tiers above it
    lack (``per_tier[i].num_leading``: tier i's answer to its first question, 0 if never
    asked). A block queued for tier i and not yet written (``inflight``) counts as tier i's."""
    num_tiers = len(tiers)
    # known[i] = (start, n): tier i holds keys[start:start+n] and not keys[start+n].
    known: list[tuple[int, int] | None] = [None] * num_tiers
    first: list[int] = [0] * num_tiers
    served: list[int] = []
    # The top tier's holdings past the first key it lacks, from one contains_many: a host tier
    # that evicted a history would otherwise be asked again for every block a lower tier
    # serves (277 calls for one 6.5K-token reload from LMDB under a small host tier, ~2 ms).
    top: list[bool] | None = None
    top_from = 0
    for p in range(len(keys)):
        for i in range(num_tiers):
            if i == 0 and top is not None:
                if p - top_from < len(top) and top[p - top_from]:
                    served.append(0)
                    break
                continue
            span = known[i]
            if span is None or p > span[0] + span[1]:  # not asked yet, or past what we know
                n = _leading(tiers, i, keys, p, inflight)
                if span is None:
                    first[i] = n
                span = known[i] = (p, n)
                if i == 0 and n == 0 and num_tiers > 1 and p + 1 < len(keys):
                    top = tiers.call(0, _contains(keys[p + 1 :]), None)
                    top_from = p + 1
            if p < span[0] + span[1]:
                served.append(i)
                break
        else:
            break
    per = tuple(TierLookup(s.name, n) for s, n in zip(tiers.stats, first, strict=True))
    return LookupResult(per_tier=per, served_by=tuple(served))


def _leading(tiers: GuardedTiers, i: int, keys: Sequence[str], p: int, inflight: InFlight) -> int:
    """How many of ``keys[p:]`` tier i holds from ``p`` on, its queued blocks included."""
    if not inflight.count(i):
        return tiers.call(i, _lookup(keys[p:]), 0)
    n = 0
    while p + n < len(keys):
        queued = inflight.leading(i, keys, p + n)
        held = (
            tiers.call(i, _lookup(keys[p + n + queued :]), 0) if p + n + queued < len(keys) else 0
        )
        if not queued and not held:
            break
        n += queued + held
    return n


def _lookup(keys: Sequence[str]) -> Callable[[Tier], int]:
    """A tier call's function, built outside the caller's loop."""
    return lambda tier: tier.lookup(keys)


def _contains(keys: Sequence[str]) -> Callable[[Tier], list[bool]]:
    return lambda tier: tier.contains_many(keys)
