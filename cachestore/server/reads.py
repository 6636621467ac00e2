"""The cache daemon's inline read path: host-tier blocks without the store's checksum pass.

``OpHandler.serve_inline`` answers a get whose keys the store's host tier (the top ``SlabTier``)
holds on the daemon's loop thread, with no worker-pool hand-off and no second xxh3 pass over
blocks this daemon already verified (put payloads are checksummed and decoded before they are
stored; lower-tier blocks are checksummed before they are promoted). What is still checked per
block is its stored codec header and size (``HierarchicalStore.prepare_load`` with a host check),
as the engine's host fast path does (docs/offload_design.md); the header of a keyed block (codec version 2)
names its key, so a block lying under another key is a miss there.

Over ZMQ frames the blocks are lent rather than copied (``HostReads.lend``): the reply frames
are the pinned slab views themselves, sent zero copy, and each block's pin is released when
ZMQ lets go of its frame (its pin handed to a spec of its own, ``split_load``, completed by a
``weakref.finalize`` on the view, run by pyzmq's garbage thread once the bytes are on the
wire). Every pin taken here is a prepared load's, released by ``complete_load`` only. That saves a 2 MiB memcpy on the loop thread per block.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachestore.codec import HeaderTemplate, decode_block
from cachestore.store.hierarchical import HierarchicalStore
from cachestore.store.loads import HostCheck, LoadSpec
from tiers.base import Tier, Value
from tiers.remote import shm
from tiers.remote.protocol import ErrorCode, ProtocolError


@dataclass(frozen=True, slots=True)
class HostRun:
    """Every key of a get located in the host slab: ``spec`` holds the pins (its
    ``host_offsets``: one per key), ``block_bytes`` each block's encoded size."""

    spec: LoadSpec
    block_bytes: int


@dataclass(frozen=True, slots=True)
class PinnedViews:
    """Every key's host block as a slab view, pinned by ``spec`` (``complete_load``)."""

    views: list[Value]
    spec: LoadSpec


class HostReads:
    """Reads of the store's host tier without the store's checksum pass (``serve_inline``).

    Remembers, per (tenant, key prefix), the codec header template (``HeaderTemplate``: the
    header for each key) and size of the blocks last seen (puts, pool-path gets): one
    namespace is one model, layout and block size, so its blocks share them. ``locate`` and
    ``pinned_views`` check each block's stored header and size against that
    (``HierarchicalStore.prepare_load``, which also pins the hits and counts them as host
    reads) -- never the xxh3 checksum, which this daemon verified when the block came in.
    Thread-safe (dict operations are atomic; the tier locks itself); never raises.
    """

    MAX_HINTS = 4096
    # Lent (pinned until ZMQ sends them) bytes at most, all clients together: a client that
    # stops reading must not pin the host tier full (other tenants' puts would fail); past
    # this, replies copy as before.
    MAX_LENT_BYTES = 256 << 20
    # Smaller blocks are copied: pyzmq releases a zero-copy frame through its garbage thread
    # (one more message and wake-up per frame), which costs more than copying less than about
    # 1 MiB (measured on 2 cores: 64 KiB and 512 KiB gets 2-4% slower lent, 1 MiB within the
    # noise, 2 MiB 15-20% faster; docs/cache_server.md).
    MIN_LENT_BYTES = 1 << 20

    def __init__(self, store: HierarchicalStore, slab: Tier) -> None:
        self._store = store
        self._slab = slab
        self._hints: dict[tuple[str, str], tuple[HeaderTemplate, int]] = {}
        self._lent_lock = threading.Lock()
        self.lent_bytes = 0  # currently lent (a gauge, for tests and metrics)
        self.num_lent = 0  # blocks lent so far (a count)

    def remember(self, tenant: str, prefix: str, header: HeaderTemplate, nbytes: int) -> None:
        if len(self._hints) >= self.MAX_HINTS and (tenant, prefix) not in self._hints:
            self._hints.clear()  # a flood of namespaces: start over rather than grow
        self._hints[(tenant, prefix)] = (header, nbytes)

    def hint(self, tenant: str, prefix: str) -> tuple[HeaderTemplate, int] | None:
        """The (codec header template, encoded size) last seen for the namespace, or None."""
        return self._hints.get((tenant, prefix))

    def learn(self, tenant: str, keys: Sequence[str], values: Sequence[Value | None]) -> None:
        """Remember the header of verified blocks (``get_many_encoded`` results) whose
        namespace has none yet, or another one."""
        for key, value in zip(keys, values, strict=True):
            if value is None:
                continue
            prefix = key.split("/", 1)[0]
            hint = self._hints.get((tenant, prefix))
            if (
                hint is not None
                and len(value) == hint[1]
                and value[: hint[0].size] == hint[0].for_key(key)
            ):
                continue
            block = decode_block(value)  # verified already; this runs once per namespace
            self.remember(
                tenant, prefix, HeaderTemplate.of_block(block.meta, block.key_digest), len(value)
            )

    def lookup(self, ikeys: list[str]) -> int:
        """Leading keys the host tier holds (0 if it fails)."""
        try:
            return self._slab.lookup(ikeys)
        except Exception:
            return 0

    def locate(self, tenant: str, keys: list[str], ikeys: list[str]) -> HostRun | None:
        """Every key's host block located in the slab, pinned (balance with
        ``store.complete_load(run.spec)``); or None (nothing pinned) unless all of them are
        there with the expected header (for a keyed block: naming that very key)."""
        prefix = keys[0].split("/", 1)[0]
        hint = self._hints.get((tenant, prefix))
        if hint is None or not all(k.startswith(prefix) and k[len(prefix)] == "/" for k in keys):
            return None
        # Membership first: a request that falls back is then not counted as a host read twice.
        if self.lookup(ikeys) < len(ikeys):
            return None
        template, nbytes = hint
        cut = len(tenant) + 1  # an internal key is ``tenant/`` + the client's key
        check = HostCheck(lambda ikey: template.for_key(ikey[cut:]), nbytes)
        spec = self._store.prepare_load(ikeys, check, claim=False)
        if len(spec.host_offsets) < len(ikeys):
            self._store.complete_load(spec)
            return None
        return HostRun(spec, nbytes)

    def pinned_views(self, tenant: str, keys: list[str], ikeys: list[str]) -> PinnedViews | None:
        """Views of every key's host block, pinned (balance with ``store.complete_load`` of
        the result's spec), or None (nothing pinned) unless all of them are there with the
        expected header."""
        located = self.locate(tenant, keys, ikeys)
        if located is None:
            return None
        try:
            views = self._slab.get_many(ikeys)
        except Exception:
            views = []
        if len(views) != len(ikeys) or any(
            v is None or len(v) != located.block_bytes for v in views
        ):
            self._store.complete_load(located.spec)  # cannot happen to pinned entries
            return None
        return PinnedViews(views, located.spec)  # type: ignore[arg-type]

    def lend(
        self,
        spec: LoadSpec,
        ikeys: Sequence[str],
        views: Sequence[Value],
        payloads: Sequence[Value],
    ) -> list[bool]:
        """Hand the pins of ``views`` (pinned by ``spec``, in ``ikeys`` order) that are also
        reply ``payloads`` (by identity) over to the views themselves: each one's pin moves to
        a spec of its own (``split_load``), completed when the last reference to its view goes
        (the caller sends it zero copy and drops it). Returns, per key, whether it was lent;
        ``spec`` keeps the others' pins (the caller completes it). Thread-safe; the release
        may run on any thread."""
        frames = {id(p) for p in payloads}
        out = []
        for ikey, view in zip(ikeys, views, strict=True):
            size = len(view)
            lent = id(view) in frames and size >= self.MIN_LENT_BYTES
            if lent:
                with self._lent_lock:
                    lent = self.lent_bytes + size <= self.MAX_LENT_BYTES
                    if lent:
                        self.lent_bytes += size
                        self.num_lent += 1
            if lent:
                weakref.finalize(view, self._give_back, self._store.split_load(spec, [ikey]), size)
            out.append(lent)
        return out

    def _give_back(self, spec: LoadSpec, size: int) -> None:
        try:
            self._store.complete_load(spec)
        finally:
            with self._lent_lock:
                self.lent_bytes -= size


def copy_out(
    values: Sequence[Value | None],
    segment: shm.ShmSegment | None,
    offset: int,
    end: int,
    rec: dict[str, Any],
    owned: bool,
) -> tuple[dict[str, Any], list[Value]]:
    """A get's reply body and frames: hits into ``segment[offset:end]`` while they fit,
    the rest as frames (copied to bytes when ``owned``). Values must stay valid (pinned)."""
    sizes: list[int] = []
    shm_offsets: list[int] = []
    payloads: list[Value] = []
    for value in values:
        if value is None:
            sizes.append(-1)
            shm_offsets.append(-1)
            continue
        size = len(value)
        sizes.append(size)
        rec["num_hits"] += 1
        rec["bytes_out"] += size
        if segment is not None and offset + size <= end:
            segment.buf[offset : offset + size] = value
            shm_offsets.append(offset)
            offset += size
            rec["path"] = "shm"
        else:
            shm_offsets.append(-1)
            payloads.append(bytes(value) if owned and not isinstance(value, bytes) else value)
    body: dict[str, Any] = {"sizes": sizes}
    if segment is not None:
        body["shm_offsets"] = shm_offsets
    return body, payloads


def shm_region(
    segments: shm.AttachedSegments | None, header: dict[str, Any], tenant: str
) -> tuple[shm.ShmSegment | None, int, int]:
    """The client segment region a request names (``shm``, ``shm_start``, ``shm_length``):
    (segment, start, end), or (None, 0, 0) when it names none or shm is off. Raises
    ``ProtocolError`` (``SHM_UNAVAILABLE``: not attached by ``tenant``; ``BAD_HEADER``)."""
    name = header.get("shm")
    if not isinstance(name, str) or segments is None:
        return None, 0, 0
    segment = segments.get(name, tenant)
    if segment is None:
        raise ProtocolError(ErrorCode.SHM_UNAVAILABLE, "unknown shared-memory segment")
    start, length = header.get("shm_start", 0), header.get("shm_length", segment.size)
    if not (
        isinstance(start, int)
        and isinstance(length, int)
        and 0 <= start
        and 0 <= length
        and start + length <= segment.size
    ):
        raise ProtocolError(ErrorCode.BAD_HEADER, "shm region out of the segment")
    return segment, start, start + length
