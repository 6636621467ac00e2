"""Block codec: round trip, zero copy, and every corruption is a typed CodecError."""

from __future__ import annotations

import struct

import pytest
import xxhash

from cachestore.codec import (
    CHECKSUM_BYTES,
    FIXED_HEADER_BYTES,
    FORMAT_VERSION,
    KEYLESS_VERSION,
    PAYLOAD_ALIGN,
    BlockMeta,
    CodecError,
    decode_block,
    encode_block,
    encode_block_into,
    encoded_size,
)
from cachestore.hashing import Namespace

NS = Namespace("tiny-llama|fp16").key_prefix()
META = BlockMeta(dtype="torch.float16", shape=(2, 2, 4, 3), layout="block_major_v1", namespace=NS)
PAYLOAD = bytes((i * 37 + 11) % 256 for i in range(META.payload_bytes))


def _block() -> bytes:
    return encode_block(PAYLOAD, META)


def test_round_trip_and_meta() -> None:
    buf = _block()
    assert len(buf) == encoded_size(META)
    out = decode_block(buf, expected_namespace=NS)
    assert out.meta == META
    assert out.meta.dtype == "float16"  # "torch." prefix dropped
    assert out.meta.shape == (2, 2, 4, 3)
    assert out.version == KEYLESS_VERSION and out.key_digest is None  # no key given
    assert bytes(out.payload) == PAYLOAD
    assert buf.endswith(struct.pack("<Q", xxhash.xxh3_64_intdigest(buf[:-CHECKSUM_BYTES])))


def test_decode_is_zero_copy_and_encode_into_writes_in_place() -> None:
    slab = bytearray(encoded_size(META) + 100)
    written = encode_block_into(memoryview(slab)[50:], PAYLOAD, META)
    assert written == encoded_size(META)
    view = memoryview(slab)[50 : 50 + written]
    out = decode_block(view)
    assert bytes(out.payload) == PAYLOAD
    # The payload aliases the slab: a change there shows through the view.
    start = 50 + written - CHECKSUM_BYTES - len(PAYLOAD)
    slab[start] ^= 0xFF
    assert out.payload[0] == PAYLOAD[0] ^ 0xFF


def test_encode_rejects_wrong_payload_size_and_small_buffer() -> None:
    with pytest.raises(ValueError, match="payload is 3 bytes"):
        encode_block(b"abc", META)
    with pytest.raises(ValueError, match="output buffer holds 10 bytes"):
        encode_block_into(bytearray(10), PAYLOAD, META)
    with pytest.raises(ValueError, match="unknown dtype"):
        BlockMeta(dtype="complex32", shape=(1,), layout="x", namespace="n")


def _expected_reason_for_flip(buf: bytes, flipped: bytes, byte: int) -> str:
    if byte < 4:
        return "bad_magic"
    if byte < 6:
        return "version"
    if 8 <= byte < FIXED_HEADER_BYTES:  # meta_len / payload_len: the declared size changes
        _, _, _, meta_len, payload_len = struct.unpack_from("<4sHHIQ", flipped)
        declared = FIXED_HEADER_BYTES + meta_len + payload_len + CHECKSUM_BYTES
        return "truncated" if declared > len(flipped) else "length_mismatch"
    return "checksum"  # flags, metadata, payload and the checksum itself


def test_every_single_bit_flip_is_detected_with_its_reason() -> None:
    buf = _block()
    reasons: dict[str, int] = {}
    for byte in range(len(buf)):
        for bit in range(8):
            flipped = bytearray(buf)
            flipped[byte] ^= 1 << bit
            with pytest.raises(CodecError) as info:
                decode_block(bytes(flipped), expected_namespace=NS)
            expected = _expected_reason_for_flip(buf, bytes(flipped), byte)
            assert info.value.reason == expected, (byte, bit)
            reasons[expected] = reasons.get(expected, 0) + 1
    assert reasons["bad_magic"] == 32 and reasons["version"] == 16
    assert reasons["truncated"] + reasons["length_mismatch"] == 96
    assert reasons["checksum"] == (len(buf) - 20 + 2) * 8


def test_truncation_at_every_seventh_byte() -> None:
    buf = _block()
    cuts = list(range(0, len(buf), 7))
    assert len(cuts) > 10
    for cut in cuts:
        with pytest.raises(CodecError) as info:
            decode_block(buf[:cut])
        assert info.value.reason == "truncated", cut


def test_trailing_bytes_are_a_length_mismatch() -> None:
    with pytest.raises(CodecError) as info:
        decode_block(_block() + b"\x00")
    assert info.value.reason == "length_mismatch"


def test_wrong_namespace() -> None:
    other = Namespace("tiny-llama|fp16", cache_salt="tenant-b").key_prefix()
    assert other != NS
    with pytest.raises(CodecError) as info:
        decode_block(_block(), expected_namespace=other)
    assert info.value.reason == "namespace"
    assert decode_block(_block()).meta.namespace == NS  # no expectation: accepted


def test_old_format_version_is_refused_even_with_a_valid_checksum() -> None:
    old = bytearray(encoded_size(META))
    encode_block_into(old, PAYLOAD, META, version=0)
    assert struct.unpack_from("<H", old, 4)[0] == 0
    body = bytes(old[:-CHECKSUM_BYTES])
    assert old[-CHECKSUM_BYTES:] == struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    with pytest.raises(CodecError) as info:
        decode_block(bytes(old))
    assert info.value.reason == "version"
    assert "format version 0" in str(info.value)


def header_bytes_unpadded(meta: BlockMeta) -> bytes:
    """The header as the format lays it out before the zero padding: fixed part, three
    length-prefixed strings, ndim, the dims."""
    out = bytearray(FIXED_HEADER_BYTES)
    for text in (meta.dtype, meta.layout, meta.namespace):
        out += struct.pack("<H", len(text.encode())) + text.encode()
    out.append(len(meta.shape))
    for dim in meta.shape:
        out += struct.pack("<Q", dim)
    return bytes(out)


def test_padding_after_the_shape_must_be_short_and_zero() -> None:
    meta = next(
        m
        for m in (BlockMeta(META.dtype, META.shape, META.layout, "n" * i) for i in range(1, 17))
        if len(header_bytes_unpadded(m)) % 16
    )
    buf = bytearray(encode_block(bytes(meta.payload_bytes), meta))
    meta_len = struct.unpack_from("<I", buf, 8)[0]
    end = FIXED_HEADER_BYTES + meta_len
    assert end > len(header_bytes_unpadded(meta)) and end % PAYLOAD_ALIGN == 0
    assert decode_block(bytes(buf)).meta == meta
    buf[end - 1] = 1  # a non-zero padding byte behind a valid checksum
    struct.pack_into("<Q", buf, len(buf) - 8, xxhash.xxh3_64_intdigest(bytes(buf[:-8])))
    with pytest.raises(CodecError) as info:
        decode_block(bytes(buf))
    assert info.value.reason == "bad_meta"


def test_bad_meta_behind_a_valid_checksum() -> None:
    # A writer bug (payload length disagreeing with the shape) is caught after the checksum.
    buf = bytearray(_block())
    meta_len = struct.unpack_from("<I", buf, 8)[0]
    pad = (FIXED_HEADER_BYTES + meta_len) - len(header_bytes_unpadded(META))
    shape_last = FIXED_HEADER_BYTES + meta_len - pad - 8
    struct.pack_into("<Q", buf, shape_last, 4)  # shape (2,2,4,4): 4 more fp16 values needed
    struct.pack_into("<Q", buf, len(buf) - 8, xxhash.xxh3_64_intdigest(bytes(buf[:-8])))
    with pytest.raises(CodecError) as info:
        decode_block(bytes(buf))
    assert info.value.reason == "bad_meta"


def test_header_bytes_prefix_and_seal_block_match_encode_block() -> None:
    from cachestore.codec import header_bytes, seal_block

    full = _block()
    header = header_bytes(META)
    assert full.startswith(header)
    assert len(header) + META.payload_bytes + CHECKSUM_BYTES == len(full)
    other = header_bytes(BlockMeta(META.dtype, META.shape, META.layout, "other-namespace"))
    assert other != header
    # Zero-padded: every payload starts 16-byte aligned after its header.
    assert len(header) % PAYLOAD_ALIGN == 0 and len(other) % PAYLOAD_ALIGN == 0
    assert header.endswith(bytes(len(header) - len(header_bytes_unpadded(META))))
    # Header + payload written in place, checksum last: byte-identical to encode_block.
    buf = bytearray(len(full))
    buf[: len(header)] = header
    buf[len(header) : len(header) + len(PAYLOAD)] = PAYLOAD
    seal_block(buf, len(full))
    assert bytes(buf) == full
    assert bytes(decode_block(buf, expected_namespace=NS).payload) == PAYLOAD


def test_keyed_block_carries_its_key_and_refuses_another() -> None:
    """Version 2: the key is in the checksummed header; read under another key it is a
    "wrong_key" CodecError (issue 16, F1: a block served under the wrong key is a miss)."""
    from cachestore.codec import header_bytes, key_digest, seal_block

    key, other = f"{NS}/{1:032x}", f"{NS}/{2:032x}"
    buf = encode_block(PAYLOAD, META, key=key)
    assert len(buf) == encoded_size(META, keyed=True) >= encoded_size(META)
    out = decode_block(buf, expected_namespace=NS, expected_key=key)
    assert out.version == FORMAT_VERSION and out.key_digest == key_digest(key)
    assert out.meta == META and bytes(out.payload) == PAYLOAD
    assert decode_block(buf).key_digest == key_digest(key)  # no expectation: accepted
    with pytest.raises(CodecError) as info:
        decode_block(buf, expected_namespace=NS, expected_key=other)
    assert info.value.reason == "wrong_key"
    # The key is checksummed: rewriting its digest in place breaks the checksum.
    forged = bytearray(buf)
    header = header_bytes(META, key)
    at = bytes(header).index(struct.pack("<Q", key_digest(key)))
    struct.pack_into("<Q", forged, at, key_digest(other))
    with pytest.raises(CodecError) as info:
        decode_block(bytes(forged), expected_key=other)
    assert info.value.reason == "checksum"
    # A keyless (version 1) block still decodes, under any key: there is nothing to check.
    assert bytes(decode_block(_block(), NS, expected_key=other).payload) == PAYLOAD
    # header_bytes(meta, key) + payload + seal_block == encode_block(..., key): the in-place
    # writers' way; one length for every key of a meta, another header per key.
    assert buf.startswith(header) and len(header) % PAYLOAD_ALIGN == 0
    assert len(header_bytes(META, other)) == len(header) and header_bytes(META, other) != header
    place = bytearray(len(buf))
    place[: len(header)] = header
    place[len(header) : len(header) + len(PAYLOAD)] = PAYLOAD
    seal_block(place, len(buf))
    assert bytes(place) == buf


def test_every_bit_flip_of_a_keyed_block_is_detected() -> None:
    key = f"{NS}/{7:032x}"
    buf = encode_block(PAYLOAD, META, key=key)
    for byte in range(len(buf)):
        flipped = bytearray(buf)
        flipped[byte] ^= 1 << (byte % 8)
        with pytest.raises(CodecError):
            decode_block(bytes(flipped), expected_namespace=NS, expected_key=key)


def test_header_template_matches_header_bytes() -> None:
    from cachestore.codec import HeaderTemplate, header_bytes

    metas = [
        META,
        *(BlockMeta("uint8", (n,), "test", "n" * i) for n, i in ((0, 1), (256, 7), (1 << 20, 13))),
    ]
    for meta in metas:
        keyed, keyless = HeaderTemplate(meta, keyed=True), HeaderTemplate(meta, keyed=False)
        for key in ("", "a/b", f"{NS}/{3:032x}", "tenant/ns/ü"):
            assert keyed.for_key(key) == header_bytes(meta, key)
            assert keyless.for_key(key) == header_bytes(meta)
            assert len(keyed.for_key(key)) == keyed.size
        assert keyed != keyless and keyed == HeaderTemplate(meta, keyed=True)
