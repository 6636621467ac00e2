"""The cache daemon's put checks: size, transport checksum and block format in one pass.

A put payload must match its declared size and transport checksum (xxh3-64 of the whole
payload) and be an encoded block (``cachestore.codec``) of its key's namespace whose own
checksum holds: the inline read path serves host blocks without re-checking them, so nothing
unchecked may get in. Both checksums are xxh3-64 and the codec's covers everything but the
block's last 8 bytes, so one streaming pass yields both (the codec's digest midway). The block
header is checked against the one the daemon last saw for the (tenant, namespace) (the
``HostReads`` hint, for the put's key: a keyed block, codec version 2, names its key); only a
block without a matching hint goes through ``decode_block``, whose second pass also names the
exact reason of a refusal. A keyed block of another key than the one it is put under is
refused (``BAD_BLOCK``): it would be served as that key's block.

``put_views`` finds the payloads (frames or the client's segment); ``store_put`` checks them,
the tenant's quota, and writes them. Thread-safe (the store and usage lock themselves).

Races: of two puts of one key at once, the later one's ``put_many`` would find nothing to
write (the store skips keys another put is writing) and answer INTERNAL (2-4% of ops under a
hostile load, docs/cache_server.md). ``PutClaims`` finds them first: a key some other request is putting is left
out of this one and counted (``num_raced``, the ``kvtier_server_put_races`` metric); a put
whose every key raced is answered ``PUT_RACED``, not an error of the store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import xxhash

from cachestore.codec import CHECKSUM_BYTES, CodecError, DecodedBlock, HeaderTemplate, decode_block
from cachestore.hashing import store_prefix_of
from tiers.remote import shm
from tiers.remote.protocol import (
    ErrorCode,
    ProtocolError,
    ServerLimits,
    checksum,
    join_frames,
)

if TYPE_CHECKING:
    from cachestore.server.reads import HostReads
    from cachestore.server.usage import NamespaceUsage
    from cachestore.store.hierarchical import HierarchicalStore

Hint = tuple[HeaderTemplate, int]  # (codec header template, encoded size) of a namespace


def check_payload(
    index: int,
    view: memoryview,
    size: int,
    digest: int,
    namespace: str,
    hint: Hint | None,
    key: str,
) -> DecodedBlock | None:
    """Check one put payload for client key ``key``. Returns None when the hint vouched for
    its header (the block is fine), the decoded block when it had to decode it. Raises
    ``ProtocolError`` (``CHECKSUM_MISMATCH``: size or transport checksum; ``BAD_BLOCK``: not a
    block of ``namespace``, a keyed block of another key, or its own checksum fails)."""
    if len(view) != size:
        raise ProtocolError(
            ErrorCode.CHECKSUM_MISMATCH,
            f"payload {index} does not match its size/checksum; nothing stored",
        )
    body: int | None = None
    if len(view) > CHECKSUM_BYTES:
        h = xxhash.xxh3_64(view[:-CHECKSUM_BYTES])
        body = h.intdigest()
        h.update(view[-CHECKSUM_BYTES:])
        whole = h.intdigest()
    else:
        whole = checksum(view)
    if whole != digest:
        raise ProtocolError(
            ErrorCode.CHECKSUM_MISMATCH,
            f"payload {index} does not match its size/checksum; nothing stored",
        )
    if (
        hint is not None
        and body is not None
        and len(view) == hint[1]
        and view[: hint[0].size] == hint[0].for_key(key)
        and body == int.from_bytes(view[-CHECKSUM_BYTES:], "little")
    ):
        return None
    try:
        return decode_block(view, namespace, expected_key=key)
    except CodecError as exc:
        what = (
            "its key's block"
            if exc.reason == "wrong_key"
            else "an encoded block of its key's namespace"
        )
        raise ProtocolError(
            ErrorCode.BAD_BLOCK, f"payload {index} is not {what} ({exc}); nothing stored"
        ) from None


def put_views(
    header: dict[str, Any],
    sizes: list[int],
    frames: list[memoryview],
    limits: ServerLimits,
    segment_of: Callable[[], shm.ShmSegment | None],
    rec: dict[str, Any],
) -> list[memoryview]:
    """A put's payloads: ``frames`` (joined where a payload was split), or views of the client's segment (``segment_of``, which
    raises ``ProtocolError`` for an unknown one) at ``shm_offsets``. Checks sizes against
    ``limits`` and offsets against the segment; raises ``ProtocolError``. No copy: the store
    copies before the put is acknowledged, and the client leaves its segment alone until then."""
    if any(s > limits.max_frame_bytes for s in sizes) or sum(sizes) > limits.max_request_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"payload over the limit ({limits.max_frame_bytes} bytes per block, "
            f"{limits.max_request_bytes} per request)",
        )
    if "shm_offsets" not in header:  # a payload over ZMQ_FRAME_BYTES came as several frames
        return join_frames(frames, sizes)
    segment = segment_of()
    offsets = header["shm_offsets"]
    if segment is None:
        raise ProtocolError(ErrorCode.SHM_UNAVAILABLE, "unknown shared-memory segment")
    if (
        not isinstance(offsets, list)
        or len(offsets) != len(sizes)
        or not all(
            isinstance(o, int) and 0 <= o and o + s <= segment.size
            for o, s in zip(offsets, sizes, strict=True)
        )
    ):
        raise ProtocolError(ErrorCode.BAD_HEADER, "shm_offsets out of the segment")
    rec["path"] = "shm"
    return [segment.buf[o : o + s] for o, s in zip(offsets, sizes, strict=True)]


class PutClaims:
    """The internal keys that requests are putting right now. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: set[str] = set()

    def claim(self, ikeys: list[str]) -> list[bool]:
        """Claim ``ikeys`` for one request; per key, whether it is this request's to write
        (False: another request holds it, or it repeats an earlier key of this one)."""
        with self._lock:
            out = []
            for k in ikeys:
                mine = k not in self._keys
                self._keys.add(k)
                out.append(mine)
            return out

    def release(self, ikeys: list[str], mine: list[bool]) -> None:
        with self._lock:
            for k, m in zip(ikeys, mine, strict=True):
                if m:
                    self._keys.discard(k)


def check_payloads(
    reads: HostReads | None, header: dict[str, Any], tenant: str, views: list[memoryview]
) -> list[Hint]:
    """``check_payload`` of every payload of a put, against its namespace's hint; the header
    templates and sizes of the blocks it had to decode (to remember once stored). Raises
    ``ProtocolError`` at the first bad payload."""
    metas = []
    for i, (view, size, digest, key) in enumerate(
        zip(views, header["sizes"], header["checksums"], header["keys"], strict=True)
    ):
        prefix = key.split("/", 1)[0]
        block = check_payload(
            i,
            view,
            size,
            digest,
            store_prefix_of(prefix),  # a head slice's block names its model's namespace
            reads.hint(tenant, prefix) if reads is not None else None,
            key,
        )
        if block is not None:
            metas.append((HeaderTemplate.of_block(block.meta, block.key_digest), size))
    return metas


def store_put(
    store: HierarchicalStore,
    usage: NamespaceUsage,
    quota: int | None,
    reads: HostReads | None,
    header: dict[str, Any],
    tenant: str,
    ikeys: list[str],
    views: list[memoryview],
    claims: PutClaims,
) -> tuple[int, int]:
    """Check every payload (``check_payload``) and the tenant's ``quota``, then write the
    keys no concurrent request is putting (``claims``) with ``put_many`` and account them;
    the header of blocks no hint vouched for is remembered (once per namespace). Returns
    (keys stored, keys left to a concurrent put). Raises ``ProtocolError`` (nothing stored):
    ``PUT_RACED`` when every key raced, ``INTERNAL`` when the store wrote nothing: the client
    must not believe the blocks are kept."""
    sizes: list[int] = header["sizes"]
    metas = check_payloads(reads, header, tenant, views)
    mine = claims.claim(ikeys)
    try:
        repeats = len(ikeys) - len(set(ikeys))
        raced = mine.count(False) - repeats
        items = [(k, v) for k, v, m in zip(ikeys, views, mine, strict=True) if m]
        accounted = [(k, s) for k, s, m in zip(ikeys, sizes, mine, strict=True) if m]
        if ikeys and not items:
            raise ProtocolError(
                ErrorCode.PUT_RACED,
                f"all {raced} keys were being written by "
                "a concurrent put; nothing of this put stored",
            )
        if quota is not None and usage.used(tenant) + usage.delta(tenant, accounted) > quota:
            raise ProtocolError(
                ErrorCode.QUOTA_EXCEEDED,
                f"namespace {tenant!r} would exceed its quota of {quota} bytes",
            )
        if items and store.put_many(items) == 0:
            # The store counted the failure (or a write of its own, a promotion, held them).
            raise ProtocolError(ErrorCode.INTERNAL, "the store did not write the blocks")
        usage.add(tenant, accounted)
    finally:
        claims.release(ikeys, mine)
    if reads is not None:
        for template, size in metas:
            reads.remember(tenant, template.meta.namespace, template, size)
    return len(items), raced
