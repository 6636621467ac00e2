"""The hierarchical store's prepared loads: one owner for the pins a load holds.

``HierarchicalStore.prepare_load(keys, host=..., claim=...)`` pins a load's blocks and answers
a ``LoadSpec``: where the data is (``host_offsets``: the slab offset of each leading block the
host tier holds, its codec header checked) and how many leading blocks are pinned somewhere.
The pins it takes, and those ``stage_load`` adds for the same load later (blocks staged into the
host tier by a load thread), are written to the spec's *lease* here; ``complete_load(spec)``
releases what the lease holds, and nothing else releases them. So a caller never counts pins:

- claims: ``StorePins.prepare_load``'s per-key claims and the pins in every pin-capable tier
  (host, lmdb), released with ``StorePins.complete_load`` (the claim accounting stays there);
- host pins: pins on host-tier entries taken by a locate or a staging, released with the host
  tier's ``unpin``, one per pin taken.

``complete_load(spec, keys)`` releases the lease's pins of those keys only (a plan that loads
fewer blocks than it located); ``complete_load(spec)`` releases the rest and closes the lease.
Completing a closed lease does nothing; pins recorded on a closed lease (a staging that ended
after its load was completed) are released at once. ``split_load(spec, keys)`` hands one pin of
each of ``keys`` over to a new spec, completed on its own (a block lent to a reply outlives the
request that pinned it).

Thread-safe: one lock guards the leases; tier calls are made outside it. Torch-free.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cachestore.codec import BlockMeta, HeaderTemplate, encoded_size
from cachestore.store.pins import StorePins


@dataclass(frozen=True, slots=True)
class HostCheck:
    """How a host-tier block is recognised without its checksum (this process wrote it): its
    stored codec header is ``header_for(key)`` and its encoded size ``nbytes``."""

    header_for: Callable[[str], bytes]
    nbytes: int

    @classmethod
    def for_meta(cls, meta: BlockMeta) -> HostCheck:
        """Keyed blocks (codec version 2) of ``meta``: a block's header names its key."""
        return cls(HeaderTemplate(meta, keyed=True).for_key, encoded_size(meta, keyed=True))


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """A prepared load: what ``prepare_load`` found and pinned, held until ``complete_load``.

    ``num_pinned``: leading keys pinned in some tier by the claim (without a claim: the host
    run's length). ``host_offsets``: tier ``host``, the slab offset of the encoded block of
    each of ``keys[:len(host_offsets)]`` (its payload starts a header later), pinned; empty
    without a host check. ``lease``: the store's record of the pins (never 0)."""

    keys: tuple[str, ...]
    num_pinned: int
    host_offsets: tuple[int, ...] = ()
    lease: int = 0


@dataclass(frozen=True, slots=True)
class StagedRun:
    """What ``stage_load`` placed: ``num_pinned`` leading keys now pinned in the host tier;
    with a host check, the slab offsets of the leading run of those that pass it."""

    num_pinned: int
    host_offsets: tuple[int, ...] = ()


@dataclass(slots=True)
class _Lease:
    claims: list[str] = field(default_factory=list)  # keys claimed by StorePins.prepare_load
    host: list[str] = field(default_factory=list)  # one entry per host-tier pin taken


LocateRun = Callable[[Sequence[str], Sequence[bytes], int], tuple[int, ...]]


class LoadLeases:
    def __init__(
        self,
        pins: StorePins,
        unpin: Callable[[Sequence[str]], None],
        locate_run: LocateRun,
        *,
        stage: Callable[[Sequence[str]], int],
    ) -> None:
        """``pins``: the store's claim accounting; ``unpin(keys)``: undo one host pin per
        key; ``locate_run(keys, headers, nbytes)``: the slab offsets of the leading run of
        ``keys`` whose host blocks pass the header check, pinned (the store's host locate);
        ``stage(keys)``: pin keys in the host tier, placing lower-tier blocks there, the number
        of leading keys pinned (``HostFastPath.stage``)."""
        self._pins = pins
        self._unpin = unpin
        self._locate_run = locate_run
        self._stage = stage
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._open: dict[int, _Lease] = {}

    def prepare(self, keys: Sequence[str], host: HostCheck | None, claim: bool) -> LoadSpec:
        """``HierarchicalStore.prepare_load``: claim, locate, and open the spec's lease."""
        num_pinned = self._pins.prepare_load(keys) if claim else 0
        offsets: tuple[int, ...] = ()
        if host is not None and keys:
            offsets = self._locate_run(keys, [host.header_for(k) for k in keys], host.nbytes)
        with self._lock:
            lease = next(self._ids)
            self._open[lease] = _Lease(list(keys) if claim else [], list(keys[: len(offsets)]))
        return LoadSpec(tuple(keys), num_pinned if claim else len(offsets), offsets, lease)

    def stage(self, spec: LoadSpec, keys: Sequence[str], host: HostCheck | None) -> StagedRun:
        """``HierarchicalStore.stage_load``: stage, locate the staged run, hold both's pins."""
        n = self._stage(keys)
        offsets: tuple[int, ...] = ()
        if host is not None and n:
            staged = keys[:n]
            offsets = self._locate_run(staged, [host.header_for(k) for k in staged], host.nbytes)
        self._hold(spec.lease, [*keys[:n], *keys[: len(offsets)]])
        return StagedRun(n, offsets)

    def _hold(self, lease: int, host: Sequence[str]) -> None:
        """Record host pins taken for ``lease``; released at once if it is closed."""
        if not host:
            return
        with self._lock:
            held = self._open.get(lease)
            if held is not None:
                held.host.extend(host)
                return
        self._unpin(host)

    def release(self, lease: int, keys: Sequence[str] | None = None) -> None:
        """Release the lease's pins (of ``keys`` only, when given; else all, closing it)."""
        with self._lock:
            held = self._open.get(lease)
            if held is None:
                return
            if keys is None:
                del self._open[lease]
                claims, host = held.claims, held.host
            else:
                drop = set(keys)
                claims = [k for k in held.claims if k in drop]
                host = [k for k in held.host if k in drop]
                held.claims = [k for k in held.claims if k not in drop]
                held.host = [k for k in held.host if k not in drop]
        if claims:
            self._pins.complete_load(claims)
        if host:
            self._unpin(host)

    def split(self, spec: LoadSpec, keys: Sequence[str]) -> LoadSpec:
        """``HierarchicalStore.split_load``: move one claim and one host pin of each entry of
        ``keys`` (those ``spec``'s lease holds) to a new lease; the new spec's ``num_pinned``
        is the leading run of ``keys`` that had a pin to move."""
        moved = _Lease()
        with self._lock:
            held = self._open.get(spec.lease)
            found = [held is not None and _move(key, held, moved) for key in keys]
            lease = next(self._ids)
            if held is not None:  # a closed lease's split is closed too
                self._open[lease] = moved
        num_pinned = next((i for i, f in enumerate(found) if not f), len(found))
        return LoadSpec(tuple(keys), num_pinned, (), lease)

    def num_open(self) -> int:
        with self._lock:
            return len(self._open)


def _move(key: str, held: _Lease, moved: _Lease) -> bool:
    """Move one claim and one host pin of ``key`` from ``held`` to ``moved``; whether any was
    there."""
    found = False
    for have, take in ((held.claims, moved.claims), (held.host, moved.host)):
        if key in have:
            have.remove(key)
            take.append(key)
            found = True
    return found
