"""Wire format of the cache daemon (``kvtier cache-server``) and its client (``tiers.remote.tier``).

Transport: ZMQ. The client holds a DEALER socket, the daemon a ROUTER socket. One message is a
multipart ZMQ message:

    request  = [header, payload_0, payload_1, ...]
    response = [header, payload_0, payload_1, ...]

``header`` is a msgpack map; payload frames are raw block bytes, sent with ``copy=False`` and
received as ``zmq.Frame`` (zero copy on both ends). ZMQ delivers a multipart message whole or
not at all, so a half-sent put can never reach the store.

Request header fields (``REQUEST_FIELDS``): ``v`` protocol version, ``id`` request id (the client
matches replies by it; pipelined requests may complete out of order), ``op``, ``token``, and per
op: ``keys`` (lookup/get/delete/put), ``sizes`` + ``checksums`` (put: one xxh3-64 per payload,
verified before anything is stored), ``shm`` (same-host fast path, see ``tiers.remote.shm``).

Response header: ``id``, ``code`` (``ErrorCode``), ``error`` (message, empty when ok), and per op
``count`` (lookup), ``sizes`` (get: ``-1`` for a miss; the payload frames carry the hits in key
order, or ``shm_offsets`` says where they were written), ``stored``/``evicted`` (put),
``deleted`` (delete), ``stats``. A get served in place over the doorbell (``cachestore.server.leases``)
answers ``slab_offsets`` (where each block lies in the daemon's host slab) instead; a request
carrying ``release: true`` first gives back the leases its connection held.

Pure data: no sockets here. Thread-safe (nothing mutable at module level).
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

from tiers.base import Value

PROTOCOL_VERSION = 1
OPS = frozenset({"hello", "lookup", "get", "put", "delete", "stats", "bye"})
# A client key is ``cachestore.hashing.block_key``: ``namespace_prefix/hex(hash)``. Anything
# else is refused before it reaches the store, so no key can smuggle a tenant separator.
KEY_RE = re.compile(r"[A-Za-z0-9._-]{1,64}/[0-9A-Za-z._-]{1,256}")
TENANT_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
# The largest frame a client sends the daemon over ZMQ: a larger put payload goes as several
# consecutive frames (``split_frames``), which the daemon joins; a request header must fit
# in one. Why: libzmq's MAXMSGSIZE is per frame and also bounds what a peer can make the
# daemon buffer during the handshake, before it is authenticated (``tiers.remote.zap``):
# times the pending peers (``ServerConfig.max_pending_handshakes``), that is the total.
# ZMQ carries hellos and fallbacks; bulk payloads take the shm segment or the TCP stream.
ZMQ_FRAME_BYTES = 256 << 10


class ErrorCode(enum.IntEnum):
    OK = 0
    BAD_FRAME = 1  # not a multipart message the protocol knows (empty, too many frames)
    BAD_HEADER = 2  # header is not msgpack, not a map, or misses/mistypes a field
    BAD_VERSION = 3
    UNKNOWN_OP = 4
    UNAUTHORIZED = 5  # missing or unknown token
    FORBIDDEN_KEY = 6  # malformed key, or a key prefix outside the token's namespace
    TOO_LARGE = 7  # a frame or a request over the size limits
    TOO_MANY_KEYS = 8
    QUOTA_EXCEEDED = 9  # the namespace's memory quota would be exceeded
    CHECKSUM_MISMATCH = 10  # a put payload does not match its checksum: nothing was stored
    SHM_UNAVAILABLE = 11  # the named shared-memory segment is unknown: re-hello or use frames
    SHUTTING_DOWN = 12
    INTERNAL = 13  # a store failure; the client treats it as a miss
    BAD_BLOCK = (
        14  # a put payload is not an encoded block (cachestore.codec) of its key's namespace
    )
    # Every key of a put was being written by a concurrent put of the same key: nothing of
    # this request was stored (the other writer's block is). Not a failure: the client goes on.
    PUT_RACED = 15


class ProtocolError(Exception):
    """A request the daemon refuses; carries the code and message sent back to the client."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Hard limits the daemon enforces on every request (a violation is an error reply)."""

    max_header_bytes: int = 1 << 20
    max_keys_per_request: int = 4096
    max_frame_bytes: int = 64 << 20
    max_request_bytes: int = 1 << 30
    max_namespace_bytes: int | None = None  # per-tenant quota on stored bytes; None: unbounded

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_keys_per_request", "max_frame_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


def zmq_max_msg_bytes(limits: ServerLimits) -> int:
    """The daemon socket's MAXMSGSIZE: a header or a payload frame, at most
    ``ZMQ_FRAME_BYTES`` (less when both ``max_header_bytes`` and twice ``max_frame_bytes``
    are smaller; twice, so a block a little over the limit gets a TOO_LARGE reply rather
    than a dropped connection), plus 4 KiB of slack."""
    return min(ZMQ_FRAME_BYTES, max(limits.max_header_bytes, 2 * limits.max_frame_bytes)) + 4096


def zmq_max_frames(limits: ServerLimits) -> int:
    """The most frames a request may have: a header and the frames of its payloads."""
    return 1 + limits.max_keys_per_request + limits.max_request_bytes // ZMQ_FRAME_BYTES


def split_frames(payloads: Sequence[Value]) -> list[Value]:
    """``payloads`` as ZMQ frames of at most ``ZMQ_FRAME_BYTES`` (views, no copy)."""
    out: list[Value] = []
    for p in payloads:
        if len(p) <= ZMQ_FRAME_BYTES:
            out.append(p)
            continue
        view = memoryview(p)
        view = view if view.format == "B" and view.ndim == 1 else view.cast("B")
        out.extend(view[i : i + ZMQ_FRAME_BYTES] for i in range(0, len(view), ZMQ_FRAME_BYTES))
    return out


def join_frames(frames: Sequence[memoryview], sizes: Sequence[int]) -> list[memoryview]:
    """Inverse of ``split_frames`` given each payload's size: frames as they are where they
    already match one payload each, else consecutive frames joined (a copy) to the sizes.
    Raises ``ProtocolError(BAD_FRAME)`` when they do not add up."""
    if len(frames) == len(sizes):
        return list(frames)
    out: list[memoryview] = []
    it = iter(frames)
    for size in sizes:
        parts: list[memoryview] = []
        have = 0
        while have < size or not parts:
            part = next(it, None)
            if part is None:
                raise ProtocolError(
                    ErrorCode.BAD_FRAME, f"{len(frames)} payload frames for {len(sizes)} keys"
                )
            parts.append(part)
            have += len(part)
        if have != size:
            raise ProtocolError(ErrorCode.BAD_FRAME, "payload frames do not add up to the sizes")
        out.append(parts[0] if len(parts) == 1 else memoryview(b"".join(parts)))
    if next(it, None) is not None:
        raise ProtocolError(
            ErrorCode.BAD_FRAME, f"{len(frames)} payload frames for {len(sizes)} keys"
        )
    return out


@dataclass(frozen=True, slots=True)
class Reply:
    header: dict[str, Any]
    payloads: list[Value]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One served request, for metrics and the access log."""

    op: str
    namespace: str
    code: ErrorCode
    num_keys: int
    num_hits: int
    bytes_in: int
    bytes_out: int
    path: str  # "tcp" (payload frames) or "shm"
    seconds: float
    num_raced: int = 0  # put keys not stored because a concurrent put was writing them


@dataclass(slots=True)
class Request:
    """A parsed, authenticated request (``OpHandler.parse``), to ``run`` or ``serve_inline``.
    ``frames[0]`` is the header frame; ``ikeys`` are the tenant's internal keys."""

    header: dict[str, Any]
    op: str
    tenant: str
    ikeys: list[str]
    frames: Sequence[Any]
    rec: dict[str, Any]
    start: float


def checksum(data: bytes | memoryview) -> int:
    """The per-payload checksum of a put (xxh3-64: ~20 GB/s, enough to catch torn data)."""
    return xxhash.xxh3_64_intdigest(data)


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def url_host(url: str) -> str:
    """The host of a ``tcp://HOST:PORT`` url, without IPv6 brackets ("" for ipc://)."""
    if not url.startswith("tcp://"):
        return ""
    return url[len("tcp://") :].rsplit(":", 1)[0].strip("[]")


def is_loopback(url: str) -> bool:
    """Whether ``url`` stays on this machine: ipc://, or a tcp:// loopback host. The daemon
    binds an open (token-less) namespace only there; a client polls only for such replies."""
    if url.startswith("ipc://"):
        return True
    host = url_host(url)
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def pack(header: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(header, use_bin_type=True)
    return packed


def unpack_request(raw: bytes | memoryview, limits: ServerLimits) -> dict[str, Any]:
    """Decode and validate a request header. Raises ``ProtocolError``; never anything else."""
    if len(raw) > limits.max_header_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"header of {len(raw)} bytes over the limit")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=0)
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise ProtocolError(ErrorCode.BAD_HEADER, f"header is not msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.BAD_HEADER, "header must be a msgpack map")
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.BAD_VERSION, f"protocol version must be {PROTOCOL_VERSION}")
    _require(header, "id", int)
    op = _require(header, "op", str)
    if op not in OPS:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}")
    if op in ("lookup", "get", "put", "delete"):
        keys = _require(header, "keys", list)
        if len(keys) > limits.max_keys_per_request:
            raise ProtocolError(
                ErrorCode.TOO_MANY_KEYS,
                f"{len(keys)} keys over the limit of {limits.max_keys_per_request}",
            )
        for key in keys:
            if not isinstance(key, str) or not KEY_RE.fullmatch(key):
                raise ProtocolError(ErrorCode.FORBIDDEN_KEY, f"malformed key {str(key)[:80]!r}")
    if op == "put":
        for field in ("sizes", "checksums"):
            values = _require(header, field, list)
            if len(values) != len(header["keys"]) or not all(
                isinstance(x, int) and x >= 0 for x in values
            ):
                raise ProtocolError(ErrorCode.BAD_HEADER, f"{field} must be one int per key")
    return header


def _require(header: dict[str, Any], field: str, kind: type) -> Any:
    value = header.get(field)
    # bool is an int subclass: refuse it where an int is meant.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(ErrorCode.BAD_HEADER, f"field {field!r} missing or not {kind.__name__}")
    return value


def error_header(request_id: int, code: ErrorCode, message: str) -> dict[str, Any]:
    return {"id": request_id, "code": int(code), "error": message}


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a token speaks for. ``key_prefixes`` empty: any ``namespace_prefix`` is allowed."""

    name: str
    key_prefixes: frozenset[str] = frozenset()

    def check_keys(self, keys: list[str]) -> None:
        """Raise ``ProtocolError(FORBIDDEN_KEY)`` for a key outside this tenant's prefixes."""
        if not self.key_prefixes:
            return
        for key in keys:
            if key.split("/", 1)[0] not in self.key_prefixes:
                raise ProtocolError(
                    ErrorCode.FORBIDDEN_KEY, f"key {key[:80]!r} is outside namespace {self.name!r}"
                )


OPEN_TENANT = Tenant("default")


class TokenTable:
    """Tokens -> tenants, from a file of ``TOKEN NAMESPACE [KEY_PREFIX ...]`` lines.

    ``#`` starts a comment. ``NAMESPACE`` names the tenant (the daemon stores its keys under
    ``NAMESPACE/``, so tenants never share a key); optional ``KEY_PREFIX`` values restrict which
    ``namespace_prefix`` (``Namespace.key_prefix()``) its keys may carry. Lookups compare digests
    of the token, never the token itself. Immutable after construction: thread-safe.
    """

    def __init__(self, entries: dict[str, Tenant]) -> None:
        self._by_digest = {_digest(token): tenant for token, tenant in entries.items()}

    @classmethod
    def parse(cls, text: str, source: str = "tokens") -> TokenTable:
        """Raises ValueError naming the line for a malformed or duplicate entry."""
        entries: dict[str, Tenant] = {}
        for lineno, line in enumerate(text.splitlines(), 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) < 2:
                raise ValueError(f"{source}:{lineno}: expected 'TOKEN NAMESPACE [KEY_PREFIX...]'")
            token, name, prefixes = fields[0], fields[1], fields[2:]
            if len(token) < 8:
                raise ValueError(f"{source}:{lineno}: token shorter than 8 characters")
            if len(token.encode()) > 255:  # the ZMTP PLAIN password carries it
                raise ValueError(f"{source}:{lineno}: token longer than 255 bytes")
            if not TENANT_RE.fullmatch(name):
                raise ValueError(
                    f"{source}:{lineno}: namespace {name!r} must match [A-Za-z0-9._-]+"
                )
            if token in entries:
                raise ValueError(f"{source}:{lineno}: duplicate token")
            entries[token] = Tenant(name, frozenset(prefixes))
        if not entries:
            raise ValueError(f"{source}: no tokens")
        return cls(entries)

    def authenticate(self, token: object) -> Tenant:
        """The tenant of ``token``; raises ``ProtocolError(UNAUTHORIZED)``."""
        if not isinstance(token, str) or not token:
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "missing token")
        tenant = self._by_digest.get(_digest(token))
        if tenant is None:
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "unknown token")
        return tenant

    @property
    def tenants(self) -> list[str]:
        return sorted({t.name for t in self._by_digest.values()})

    def one_open_namespace(self) -> bool:
        """True when every token speaks for the same tenant with no key-prefix restriction:
        any token may then read every block the daemon holds, which is what a mapping of the
        host slab exposes (``cachestore.server.leases``)."""
        tenants = set(self._by_digest.values())
        return len(tenants) == 1 and not next(iter(tenants)).key_prefixes


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()
