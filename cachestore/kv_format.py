"""Sizes of the stored KV block formats, torch-free: ``connectors.device.kv_compress`` encodes the
lossless ``hi4`` format with this layout, and ``kvtier analyze`` prices tiers holding it.

``hi4`` (``compression: lossless``) cuts a block into ``S = 2 * num_layers`` segments of ``M``
2-byte values (one layer's K or V) and stores, 16-byte aligned::

    count  u16[S] | idx u16[S, E] | esc u8[S, E] | book u8[S, 16] | codes u8[S, M / 2] | low u8[S, M]

with ``E = max(8, M / 128 rounded up to 8)`` escapes a segment: 12 bits a value plus ~1.2%.
"""

from __future__ import annotations

ENGINE_BLOCK_TOKENS = 16  # the serving engine's KV page: what a stored block holds
COMPRESSIONS = ("none", "lossless")


def pad16(n: int) -> int:
    """``n`` rounded up to a multiple of 16 (offsets stay 16-byte aligned)."""
    return -(-n // 16) * 16


def hi4_escapes(segment_values: int) -> int:
    """Escape entries a segment of ``segment_values`` values holds."""
    return max(8, -(-(segment_values // 128) // 8) * 8)


def hi4_layout(num_segments: int, segment_values: int) -> dict[str, int]:
    """Byte offset of each part of a ``hi4`` payload (``end``: the payload's size). Raises
    ValueError unless segments are even and hold 2..65536 values (u16 escape positions)."""
    s, m = num_segments, segment_values
    if s < 1 or m < 2 or m % 2 or m > 1 << 16:
        raise ValueError(f"hi4 needs an even segment of 2..65536 values, got {m}")
    e = hi4_escapes(m)
    out: dict[str, int] = {"count": 0}
    out["idx"] = pad16(2 * s)
    out["esc"] = out["idx"] + 2 * s * e
    out["book"] = pad16(out["esc"] + s * e)
    out["codes"] = out["book"] + 16 * s
    out["low"] = pad16(out["codes"] + s * m // 2)
    out["end"] = pad16(out["low"] + s * m)
    return out


def stored_bytes_per_token(
    kv_bytes_per_token: int,
    num_layers: int,
    compression: str,
    block_tokens: int = ENGINE_BLOCK_TOKENS,
) -> int:
    """Bytes a token of KV takes in the tiers (rounded up) for 2-byte KV of ``num_layers``
    layers stored as ``compression``. Raises ValueError for an unknown compression or a
    geometry the format cannot hold."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"unknown KV compression {compression!r}; choose one of {COMPRESSIONS}")
    if compression == "none":
        return kv_bytes_per_token
    raw = kv_bytes_per_token * block_tokens
    segments = 2 * num_layers
    if num_layers < 1 or raw % (2 * segments):
        raise ValueError(
            f"{kv_bytes_per_token} B/token does not split into {segments} segments of 2-byte values"
        )
    payload = hi4_layout(segments, raw // (2 * segments))["end"]
    return -(-payload // block_tokens)
