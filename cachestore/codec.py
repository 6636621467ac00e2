"""The encoded form of one KV block, as every tier stores it (DESIGN.md, "Keys").

Layout (all integers little-endian)::

    fixed header  magic "KVTB" | version u16 | flags u16 | meta_len u32 | payload_len u64
    meta          dtype, layout, namespace (each u16 length + UTF-8) | ndim u8 | ndim x u64 shape
                  | key u64 (version 2 only) | zero padding to a multiple of 16
    payload       payload_len raw bytes
    checksum      xxh3_64 over everything above, u64

Version 2 (``encode_block(..., key=...)``) carries the block's own key: ``key_digest(key)``
(xxh3_64 of the key's UTF-8, e.g. ``prefix/hash`` as the engine or a cache-server client
names it), inside the checksummed header. A reader that knows which key it asked for
(``decode_block(..., expected_key=...)``) then refuses a block of another key ("wrong_key"),
so a block served under the wrong key is a miss, never data. Version 1 blocks
(no key; what ``encode_block`` without a key still writes) decode as before: a reader cannot
check their key. A keyed block is ``encoded_size(meta, keyed=True)`` bytes: 0 or 16 more.

Decoding checks, in this order: the buffer holds a fixed header ("truncated"), the magic
("bad_magic"), the version ("version"), that the declared lengths match the buffer
("truncated" when it is shorter, "length_mismatch" when longer), the checksum ("checksum"),
that the metadata parses ("bad_meta"), the namespace ("namespace") and the key
("wrong_key"). A block that fails any check is a miss to the store, never wrong data.

Torch-free; pure functions. ``decode_block`` is zero copy: the payload is a memoryview into the
caller's buffer and is valid as long as that buffer is.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"KVTB"
FORMAT_VERSION = 2  # keyed blocks
KEYLESS_VERSION = 1  # no key in the header: still written without a key, and read
_FIXED = struct.Struct("<4sHHIQ")
FIXED_HEADER_BYTES = _FIXED.size  # 20
PAYLOAD_ALIGN = 16  # the header (fixed part + meta) is zero-padded to a multiple of this
CHECKSUM_BYTES = 8
_U16 = struct.Struct("<H")
_U64 = struct.Struct("<Q")

# Bytes per element of the dtypes a KV cache uses; "torch." prefixes are accepted and dropped.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
}


class CodecError(Exception):
    """An encoded block that cannot be trusted. ``reason`` is one of the module's reason codes."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a reader needs to interpret a payload. ``namespace`` is ``Namespace.key_prefix()``."""

    dtype: str
    shape: tuple[int, ...]
    layout: str
    namespace: str

    def __post_init__(self) -> None:
        dtype = self.dtype.removeprefix("torch.")
        if dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {sorted(DTYPE_ITEMSIZE)}")
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if len(self.shape) > 255 or any(d < 0 for d in self.shape):
            raise ValueError(f"bad shape {self.shape}: at most 255 non-negative dimensions")
        for name in ("layout", "namespace"):
            if len(getattr(self, name).encode()) > 0xFFFF:
                raise ValueError(f"{name} longer than 65535 bytes")

    @property
    def payload_bytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


@dataclass(frozen=True, slots=True)
class DecodedBlock:
    meta: BlockMeta
    payload: memoryview  # a view into the decoded buffer (zero copy)
    version: int
    key_digest: int | None = None  # ``key_digest`` of the block's key; None: version 1


# Bound once: the key digest is no pass over a block's bytes (tests count those through
# ``codec.xxhash``: the host fast paths must not checksum).
_xxh3_of_key = xxhash.xxh3_64_intdigest


def key_digest(key: str) -> int:
    """The 64-bit digest of ``key`` a version-2 block carries (xxh3_64 of its UTF-8). Pure."""
    return _xxh3_of_key(key.encode())


def _meta_unpadded(meta: BlockMeta) -> bytearray:
    """dtype, layout, namespace, ndim and shape: the meta before the key and the padding."""
    out = bytearray()
    for text in (meta.dtype, meta.layout, meta.namespace):
        raw = text.encode()
        out += _U16.pack(len(raw)) + raw
    out.append(len(meta.shape))
    for dim in meta.shape:
        out += _U64.pack(dim)
    return out


def _meta_bytes(meta: BlockMeta, digest: int | None = None) -> bytes:
    out = _meta_unpadded(meta)
    if digest is not None:
        out += _U64.pack(digest)
    # Zero padding up to a multiple of PAYLOAD_ALIGN: the payload then starts 16-byte aligned
    # wherever the block does (a GPU kernel reads it from host memory in 16-byte words).
    out += bytes(-(FIXED_HEADER_BYTES + len(out)) % PAYLOAD_ALIGN)
    return bytes(out)


def encoded_size(meta: BlockMeta, keyed: bool = False) -> int:
    """Exact encoded size of a block with ``meta`` (``keyed``: a version-2 block, with its
    key); the host tier sizes its slots with it."""
    meta_len = len(_meta_bytes(meta, 0 if keyed else None))
    return FIXED_HEADER_BYTES + meta_len + meta.payload_bytes + CHECKSUM_BYTES


def encode_block_into(
    out: memoryview | bytearray,
    payload: bytes | memoryview,
    meta: BlockMeta,
    *,
    key: str | None = None,
    version: int | None = None,
) -> int:
    """Write the encoded block at the start of ``out`` (mutates it); return the bytes written.
    ``key``: the block's key, carried in the header (version 2); None: a version-1 block.

    Raises ValueError when the payload size does not match ``meta`` or ``out`` is too small.
    ``version`` exists so that tests can write another format number; callers leave it alone.
    """
    view = memoryview(payload).cast("B")
    if view.nbytes != meta.payload_bytes:
        raise ValueError(
            f"payload is {view.nbytes} bytes but {meta.dtype}{list(meta.shape)} "
            f"needs {meta.payload_bytes}"
        )
    meta_raw = _meta_bytes(meta, None if key is None else key_digest(key))
    if version is None:
        version = KEYLESS_VERSION if key is None else FORMAT_VERSION
    total = FIXED_HEADER_BYTES + len(meta_raw) + view.nbytes + CHECKSUM_BYTES
    dest = memoryview(out).cast("B")
    if dest.nbytes < total:
        raise ValueError(f"output buffer holds {dest.nbytes} bytes, block needs {total}")
    _FIXED.pack_into(dest, 0, MAGIC, version, 0, len(meta_raw), view.nbytes)
    pos = FIXED_HEADER_BYTES
    dest[pos : pos + len(meta_raw)] = meta_raw
    pos += len(meta_raw)
    dest[pos : pos + view.nbytes] = view
    pos += view.nbytes
    _U64.pack_into(dest, pos, xxhash.xxh3_64_intdigest(dest[:pos]))
    return total


def encode_block(payload: bytes | memoryview, meta: BlockMeta, key: str | None = None) -> bytes:
    """The encoded block as new bytes (``key``: carried in it, version 2). Raises ValueError
    on a size mismatch."""
    out = bytearray(encoded_size(meta, keyed=key is not None))
    encode_block_into(out, payload, meta, key=key)
    return bytes(out)


def _parse_meta(raw: memoryview, keyed: bool) -> tuple[BlockMeta, int | None]:
    pos = 0
    texts = []
    for _ in range(3):
        (n,) = _U16.unpack_from(raw, pos)
        texts.append(bytes(raw[pos + 2 : pos + 2 + n]).decode())
        pos += 2 + n
    ndim = raw[pos]
    shape = tuple(_U64.unpack_from(raw, pos + 1 + 8 * i)[0] for i in range(ndim))
    pos += 1 + 8 * ndim
    digest = None
    if keyed:
        (digest,) = _U64.unpack_from(raw, pos)
        pos += 8
    pad = raw[pos:]
    if pad.nbytes >= PAYLOAD_ALIGN or any(pad):
        raise ValueError("trailing bytes after shape")
    return BlockMeta(dtype=texts[0], layout=texts[1], namespace=texts[2], shape=shape), digest


def decode_block(
    buf: bytes | bytearray | memoryview,
    expected_namespace: str | None = None,
    expected_key: str | None = None,
) -> DecodedBlock:
    """Check and decode one block; ``expected_key``: the key it was read under, refused
    ("wrong_key") when a version-2 block carries another (a version-1 block has no key to
    check). Pure; raises CodecError (see module docstring for reasons)."""
    view = memoryview(buf).cast("B")
    if view.nbytes < FIXED_HEADER_BYTES:
        raise CodecError("truncated", f"{view.nbytes} bytes, header needs {FIXED_HEADER_BYTES}")
    magic, version, _flags, meta_len, payload_len = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError("bad_magic", f"{magic!r}")
    if version not in (KEYLESS_VERSION, FORMAT_VERSION):
        raise CodecError(
            "version",
            f"format version {version}, this build reads {KEYLESS_VERSION} and {FORMAT_VERSION}",
        )
    body_end = FIXED_HEADER_BYTES + meta_len + payload_len
    total = body_end + CHECKSUM_BYTES
    if view.nbytes < total:
        raise CodecError("truncated", f"{view.nbytes} bytes, header declares {total}")
    if view.nbytes > total:
        raise CodecError("length_mismatch", f"{view.nbytes} bytes, header declares {total}")
    (stored,) = _U64.unpack_from(view, body_end)
    if xxhash.xxh3_64_intdigest(view[:body_end]) != stored:
        raise CodecError("checksum")
    try:
        meta, digest = _parse_meta(
            view[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + meta_len],
            keyed=version == FORMAT_VERSION,
        )
    except (ValueError, struct.error, IndexError, UnicodeDecodeError) as exc:
        raise CodecError("bad_meta", str(exc)) from None
    if meta.payload_bytes != payload_len:
        raise CodecError("bad_meta", f"shape needs {meta.payload_bytes} bytes, got {payload_len}")
    if expected_namespace is not None and meta.namespace != expected_namespace:
        raise CodecError("namespace", f"{meta.namespace!r} != {expected_namespace!r}")
    if expected_key is not None and digest is not None and digest != key_digest(expected_key):
        raise CodecError("wrong_key", f"the block is another key's, not {expected_key!r}'s")
    start = FIXED_HEADER_BYTES + meta_len
    return DecodedBlock(meta=meta, payload=view[start:body_end], version=version, key_digest=digest)


def header_bytes(meta: BlockMeta, key: str | None = None) -> bytes:
    """The exact bytes an encoded block with ``meta`` (and ``key``: version 2; None: version
    1) starts with (fixed header + meta), i.e. everything before the payload. Deterministic
    per (``meta``, ``key``): comparing a stored block's first ``len(header_bytes(meta, key))``
    bytes with it checks magic, version, flags, lengths, dtype, layout, namespace, shape and
    the key at once (not the checksum). Its length depends on ``meta`` and on whether there
    is a key, not on which key. Pure."""
    meta_raw = _meta_bytes(meta, None if key is None else key_digest(key))
    version = KEYLESS_VERSION if key is None else FORMAT_VERSION
    return _FIXED.pack(MAGIC, version, 0, len(meta_raw), meta.payload_bytes) + meta_raw


def block_key_of(store_key: str, skip: int) -> str:
    """The key a block carries for a store key with ``skip`` leading ``/`` components that
    are not part of it (the cache daemon's tenant: ``tenant/prefix/hash`` -> ``prefix/hash``)."""
    parts = store_key.split("/", skip)
    return parts[skip] if len(parts) > skip else store_key


def seal_block(out: memoryview | bytearray, total: int) -> None:
    """Write the checksum of an encoded block whose header and payload are already in
    ``out[:total - CHECKSUM_BYTES]`` (e.g. the header from ``header_bytes`` and a payload a
    device copied in place). Mutates ``out``; the result decodes like ``encode_block``'s."""
    dest = memoryview(out).cast("B")
    body_end = total - CHECKSUM_BYTES
    _U64.pack_into(dest, body_end, xxhash.xxh3_64_intdigest(dest[:body_end]))


class HeaderTemplate:
    """``header_bytes(meta, key)`` for many keys of one ``meta``, cheaply: one xxh3 of the key
    and a concatenation per key (the fast paths compare or write one header per block).
    ``keyed`` False: the version-1 header, the same for every key. Immutable: thread-safe."""

    __slots__ = ("meta", "keyed", "size", "_head", "_tail")

    def __init__(self, meta: BlockMeta, keyed: bool) -> None:
        self.meta = meta
        self.keyed = keyed
        full = header_bytes(meta, "" if keyed else None)
        self.size = len(full)
        if keyed:  # the digest sits right after the shape, before the zero padding
            at = FIXED_HEADER_BYTES + len(_meta_unpadded(meta))
            self._head, self._tail = full[:at], full[at + 8 :]
        else:
            self._head, self._tail = full, b""

    @classmethod
    def of_block(cls, meta: BlockMeta, key_digest_or_none: int | None) -> HeaderTemplate:
        """The template of a decoded block (``DecodedBlock.meta``, ``.key_digest``)."""
        return cls(meta, keyed=key_digest_or_none is not None)

    def for_key(self, key: str) -> bytes:
        """The header a block of ``key`` starts with (``key`` ignored when not keyed)."""
        if not self.keyed:
            return self._head
        return self._head + _U64.pack(key_digest(key)) + self._tail

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, HeaderTemplate)
            and self.meta == other.meta
            and self.keyed == other.keyed
        )

    def __hash__(self) -> int:
        return hash((self.meta, self.keyed))
