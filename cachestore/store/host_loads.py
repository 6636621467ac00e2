"""The hierarchical store's pinning API: the host fast path, prepared loads, in-flight stores.

``HostLoads`` is the part of ``HierarchicalStore`` that hands out pins and takes them back (a
base class of it, over the store's parts):

- Host fast path (``*_host``, when the top tier is a ``SlabTier``): in-place reads and writes
  of the host slab for the offload connector (``cachestore.store.host``).
- Loads (``prepare_load`` -> ``LoadSpec``, ``stage_load``, ``split_load``, ``complete_load``:
  the one owner of a load's pins, ``cachestore.store.loads``). ``complete_load`` is the one
  release of a located host block's pin; a reader's own pins (``get_many_pinned``,
  ``stage_host``) are undone with ``unpin_host``.
- In-flight stores (``prepare_store``/``complete_store``): ``cachestore.store.pins``.

Thread-safe as the parts are. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cachestore.store.host import HostFastPath
from cachestore.store.loads import HostCheck, LoadLeases, LoadSpec, StagedRun
from cachestore.store.pins import StorePins
from cachestore.store.types import SlabTier
from cachestore.store.write_through import WriteThrough


class HostLoads:
    """The store's pin-handling methods; ``HierarchicalStore`` sets the parts."""

    _host: HostFastPath
    _loads: LoadLeases
    _pins: StorePins
    _through: WriteThrough

    # -- host fast path (cachestore.store.host) --------------------------------------------

    def host_slab(self) -> SlabTier | None:
        """The top tier when it is a slab tier (``locate``/``reserve``/``commit``), else None."""
        return self._host.slab

    def _locate_host_run(
        self, keys: Sequence[str], header: bytes | Sequence[bytes], nbytes: int
    ) -> tuple[int, ...]:
        """Slab offsets of the leading run of ``keys`` whose host blocks pass the header
        check, pinned (hits past it unpinned): ``HostFastPath.locate``, counted as hits for the
        selective write-through tiers, then ``HostFastPath.keep_run``. Only ``prepare_load``
        and ``stage_load`` call it: their spec holds the pins."""
        out = self._host.locate(keys, header, nbytes)
        self._through.hit([k for k, o in zip(keys, out, strict=True) if o is not None])
        return self._host.keep_run(keys, out)

    def stage_host(self, keys: Sequence[str]) -> int:
        """Pin ``keys`` in the host tier, placing lower-tier blocks there when all fit; the
        number of leading keys pinned: ``HostFastPath.stage``. For a background thread."""
        return self._host.stage(keys)

    def unpin_host(self, keys: Sequence[str]) -> None:
        """Undo ``stage_host``'s and ``get_many_pinned``'s pins (a prepared load's pins are
        released by ``complete_load`` only)."""
        self._host.unpin(keys)

    def reserve_host(self, key: str, nbytes: int) -> Any:
        """A host slot to write ``key`` in place, or None: ``HostFastPath.reserve``."""
        return self._host.reserve(key, nbytes)

    def commit_host(self, key: str, nbytes: int) -> bool:
        """Make a reserved slot visible (its bytes must be a whole encoded block); queued for
        the write-through tiers."""
        ok = self._host.commit(key, nbytes)
        if ok:
            self._through.saved([key])
        return ok

    def abort_host(self, key: str) -> None:
        """Free a reserved slot (the copy into it failed)."""
        self._host.abort(key)

    # -- pins (cachestore.store.pins, cachestore.store.loads) --------------------------------

    def prepare_store(self, keys: Sequence[str]) -> list[str]:
        """The keys this caller should store: not at the top tier and not being stored by
        someone else. They stay reserved until ``complete_store``."""
        return self._pins.prepare_store(keys)

    def complete_store(self, keys: Sequence[str], success: bool) -> None:
        """Release keys from ``prepare_store``; ``success`` is for the caller's bookkeeping:
        the bytes are visible as soon as ``put_many`` (or a host ``commit``) returned."""
        self._pins.complete_store(keys)

    def prepare_load(
        self, keys: Sequence[str], host: HostCheck | None = None, *, claim: bool = True
    ) -> LoadSpec:
        """Pin a load's blocks and say where they are (``cachestore.store.loads``). ``claim``:
        pin each key in every pin-capable tier holding it (one ``pin_each`` call per tier;
        ``num_pinned``: leading keys pinned somewhere). ``host``: also the slab offsets of the
        leading run of keys whose host blocks pass ``host``'s check, pinned (``host_offsets``;
        each hit counts as a host read). Balance with ``complete_load(spec)``. Never raises for
        tier failures."""
        return self._loads.prepare(keys, host, claim)

    def stage_load(
        self, spec: LoadSpec, keys: Sequence[str], host: HostCheck | None = None
    ) -> StagedRun:
        """``stage_host(keys)`` for a prepared load, its pins held by ``spec`` until
        ``complete_load(spec)``; with ``host``, the slab offsets of the leading run of the
        staged blocks that pass its check. For a background thread."""
        return self._loads.stage(spec, keys, host)

    def split_load(self, spec: LoadSpec, keys: Sequence[str]) -> LoadSpec:
        """Hand one pin of each entry of ``keys`` (a key listed twice: two) over from ``spec``
        to a new spec, released by its own ``complete_load``; ``spec`` keeps the rest. For a
        block that outlives the request that pinned it (a reply frame lent to ZMQ)."""
        return self._loads.split(spec, keys)

    def complete_load(self, spec: LoadSpec, keys: Sequence[str] | None = None) -> None:
        """Release the pins ``spec`` holds (of ``keys`` only, when given), one ``unpin`` call
        per tier. The one release of ``prepare_load``'s, ``stage_load``'s and ``split_load``'s
        pins."""
        self._loads.release(spec.lease, keys)
