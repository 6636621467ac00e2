"""Chained block hashes: the one key scheme from GPU to S3 (DESIGN.md, "Keys").

``h[i] = H(h[i-1] || token_ids[i] as int32 LE || extra_keys[i])`` and ``h[-1] = H(namespace)``.
``H`` is sha256 by default (collision resistant, which tenant isolation needs) or xxh128 as an
opt-in for speed. Python's ``hash()`` is never used: keys must be equal across processes,
restarts and machines.

Torch-free. Pure functions only; nothing here mutates shared state.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NewType

import xxhash

BlockHash = NewType("BlockHash", bytes)
# A block's key in every tier: ``namespace_prefix/hex(hash)``, built only by ``block_key``.
BlockKey = NewType("BlockKey", str)
HashFn = Callable[[bytes], bytes]

# Bumped whenever the byte layout of a cached KV block changes (engine/kv_cache.py).
KV_LAYOUT_VERSION = 1
DEFAULT_BLOCK_SIZE = 16


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def xxh128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


HASH_FNS: dict[str, HashFn] = {"sha256": sha256, "xxh128": xxh128}


def get_hash_fn(name: str) -> HashFn:
    try:
        return HASH_FNS[name]
    except KeyError:
        raise ValueError(f"unknown block hash {name!r}; choose one of {sorted(HASH_FNS)}") from None


def _encode_extra(extra_keys: Sequence[object] | None) -> bytes:
    # Extra keys (multimodal hashes, LoRA ids) are encoded as length-prefixed UTF-8 of repr-free
    # str() values so that they are stable across processes.
    if not extra_keys:
        return b""
    out = bytearray(b"\x00X")
    for key in extra_keys:
        raw = key if isinstance(key, bytes) else str(key).encode()
        out += struct.pack("<I", len(raw)) + raw
    return bytes(out)


def hash_block_tokens(
    parent: BlockHash,
    token_ids: Sequence[int],
    extra_keys: Sequence[object] | None = None,
    hash_fn: HashFn = sha256,
) -> BlockHash:
    """Hash one block given its parent's hash. Pure; raises ValueError on out-of-range ids."""
    return BlockHash(hash_fn(parent + _pack_int32(token_ids) + _encode_extra(extra_keys)))


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that makes two caches incompatible; its hash seeds every chain.

    ``model_fingerprint`` names the architecture, the weights' identity and the dtype
    (see ``engine.models.loader.model_fingerprint``). ``cache_salt`` isolates tenants.
    ``kv_format`` names a stored block format other than the raw one (the offload
    connector's ``compression``), so blocks of two formats never share a key.
    ``kv_heads`` ``(lo, hi)``: the stored object holds KV heads ``[lo, hi)`` of each block
    (kvtier's engine under tensor parallelism, docs/tp.md); None: all of them. It names the
    key (``key_prefix``), not the chain: every TP degree hashes the same tokens to the same
    chain, so an engine at any degree finds the head slices another degree stored.
    ``tp_rank``/``tp_size`` are for the vLLM and SGLang connectors, which key per rank.
    """

    model_fingerprint: str
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_layout_version: int = KV_LAYOUT_VERSION
    tp_rank: int = 0
    tp_size: int = 1
    cache_salt: str = ""
    hash_name: str = "sha256"
    kv_format: str = ""
    kv_heads: tuple[int, int] | None = None
    # Derived once (a hash of describe()); every block key and chain seed reuses it.
    _seed: bytes = field(init=False, repr=False, compare=False, default=b"")
    _prefix: str = field(init=False, repr=False, compare=False, default="")

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} out of range for tp_size {self.tp_size}")
        if self.kv_heads is not None and not 0 <= self.kv_heads[0] < self.kv_heads[1]:
            raise ValueError(f"kv_heads must be a range lo < hi, got {self.kv_heads}")
        fn = get_hash_fn(self.hash_name)
        object.__setattr__(self, "_seed", fn(self.describe().encode()))
        heads = "" if self.kv_heads is None else f".h{self.kv_heads[0]}-{self.kv_heads[1]}"
        object.__setattr__(self, "_prefix", self._seed.hex()[:16] + heads)

    def describe(self) -> str:
        return (
            f"kvtier/v{self.kv_layout_version}|model={self.model_fingerprint}|bs={self.block_size}"
            f"|tp={self.tp_rank}/{self.tp_size}|salt={self.cache_salt}|h={self.hash_name}"
            + (f"|fmt={self.kv_format}" if self.kv_format else "")
        )

    @property
    def hash_fn(self) -> HashFn:
        return get_hash_fn(self.hash_name)

    def seed(self) -> BlockHash:
        """``h[-1]``: the hash of this namespace."""
        return BlockHash(self._seed)

    def key_prefix(self) -> str:
        """Short stable prefix tiers put in front of ``hex(h[i])`` (``namespace/hex``): the
        store prefix, plus ``.h<lo>-<hi>`` for a slice of the KV heads."""
        return self._prefix

    def store_prefix(self) -> str:
        """The namespace without the head range: what a stored block's header names and what
        its store checks, the same for every slice of one model's blocks."""
        return self._seed.hex()[:16]


_HEAD_RANGE = re.compile(r"\.h\d+-\d+$")


def store_prefix_of(key_prefix: str) -> str:
    """``Namespace.store_prefix`` from a key's prefix (the part before ``/``): without its
    ``.h<lo>-<hi>`` head range, the namespace a stored block's header names. Pure."""
    return _HEAD_RANGE.sub("", key_prefix)


def _pack_int32(token_ids: Sequence[int]) -> bytes:
    """``token_ids`` as int32 little-endian bytes; ValueError on out-of-range ids."""
    try:
        return struct.pack(f"<{len(token_ids)}i", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must fit in int32: {exc}") from None


def hash_request_tokens(
    namespace: Namespace,
    token_ids: Sequence[int],
    extra_keys: Iterable[Sequence[object] | None] | None = None,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of every *full* block of ``token_ids``; a trailing partial block is not hashed.
    Equal to chaining ``hash_block_tokens`` block by block; the ids are packed once (a 16K
    prompt hashes in about half the time of per-block packing)."""
    bs = namespace.block_size
    fn = namespace.hash_fn
    prev = namespace.seed() if parent is None else parent
    extras = list(extra_keys) if extra_keys is not None else None
    n = len(token_ids) // bs
    body = _pack_int32(token_ids[: n * bs])
    step = 4 * bs
    out: list[BlockHash] = []
    for i in range(n):
        extra = extras[i] if extras is not None and i < len(extras) else None
        tail = _encode_extra(extra) if extra else b""
        prev = BlockHash(fn(prev + body[i * step : (i + 1) * step] + tail))
        out.append(prev)
    return out


def block_key(namespace: Namespace, block_hash: BlockHash) -> BlockKey:
    """The tier key of one block: ``namespace_prefix/hex(hash)``."""
    return key_of_digest(namespace._prefix, block_hash.hex())


def key_of_digest(key_prefix: str, digest_hex: str) -> BlockKey:
    """``key_prefix/digest_hex``: the one place a block key is formatted (``block_key``; a
    connector whose engine names blocks by its own digests passes those)."""
    return BlockKey(f"{key_prefix}/{digest_hex}")
