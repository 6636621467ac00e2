"""Faults: corrupt values planted directly in each backend, and backends that die and return.

Corrupt values are written behind the tier's back — with the ``lmdb`` module, redis-py ``SET``
and boto3 ``put_object`` — then read through the tier and the codec: every one must be a miss
(``None`` from the tier) or a ``CodecError`` with the expected reason, never a decoded block.

NOTE: the same plants read through ``cachestore.store.HierarchicalStore`` (misses plus the
corruption counter), and store reads/writes while a server is killed, belong here once the
store lands; until then the tier-level part below is what protects the store's inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import msgpack
import pytest

from cachestore.codec import BlockMeta, CodecError, decode_block, encode_block, encode_block_into
from cachestore.hashing import Namespace
from tests.servers import RedisServer, S3Server
from tests.tiers.conftest import MakeTier
from tiers.base import Tier, TierError
from tiers.redis import RedisTier, RedisTierConfig

NS = Namespace(model_fingerprint="faults").key_prefix()
OTHER_NS = Namespace(model_fingerprint="someone-else").key_prefix()
META = BlockMeta(dtype="float16", shape=(2, 16, 64), layout="block_major_v1", namespace=NS)
PAYLOAD = bytes(range(256)) * (META.payload_bytes // 256)
KEY = f"{NS}/{'ab' * 32}"


def _bit_flip(block: bytes) -> bytes:
    out = bytearray(block)
    out[len(out) // 2] ^= 0x10  # inside the payload
    return bytes(out)


def _old_version(_: bytes) -> bytes:
    out = bytearray(len(encode_block(PAYLOAD, META)))
    encode_block_into(out, PAYLOAD, META, version=0)
    return bytes(out)


def _wrong_namespace(_: bytes) -> bytes:
    other = BlockMeta(dtype=META.dtype, shape=META.shape, layout=META.layout, namespace=OTHER_NS)
    return encode_block(PAYLOAD, other)


# name -> (corrupt(valid block) -> planted bytes, the CodecError reason expected)
CORRUPTIONS: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "bit_flip": (_bit_flip, "checksum"),
    "truncated": (lambda b: b[: len(b) - 100], "truncated"),
    "wrong_namespace": (_wrong_namespace, "namespace"),
    "old_version": (_old_version, "version"),
    "garbage": (lambda b: b"\x00" * 64, "bad_magic"),
}


def read_through_codec(tier: Tier, key: str) -> str:
    """What the store would see: "miss", "ok", or the CodecError reason."""
    (raw,) = tier.get_many([key])
    if raw is None:
        return "miss"
    try:
        block = decode_block(raw, expected_namespace=NS)
    except CodecError as exc:
        return exc.reason
    assert bytes(block.payload) == PAYLOAD  # decoded means exactly what was written
    return "ok"


def plant(kind: str, make_tier: MakeTier, tier: Tier, bad: bytes) -> Tier:
    """Overwrite ``KEY`` with ``bad`` directly in the backend; return a tier to read it with."""
    if kind == "redis":
        import redis

        raw = redis.Redis.from_url(tier.config.url)  # type: ignore[attr-defined]
        raw.set(tier.config.key_prefix + KEY, bad)  # type: ignore[attr-defined]
        raw.close()
        return tier
    if kind == "s3":
        s3 = tier._s3  # type: ignore[attr-defined]  # the same endpoint and credentials
        bucket, prefix = tier.config.bucket, tier.config.prefix  # type: ignore[attr-defined]
        pointer = msgpack.unpackb(
            s3.get_object(Bucket=bucket, Key=f"{prefix}k/{KEY}")["Body"].read())
        s3.put_object(Bucket=bucket, Key=pointer["g"], Body=bad)
        if len(bad) != pointer["n"][0]:  # keep the manifest honest about the planted length
            pointer["n"] = [len(bad)]
            s3.put_object(Bucket=bucket, Key=f"{prefix}k/{KEY}", Body=msgpack.packb(pointer))
        return tier
    # lmdb: one process may not open an environment twice, so close the tier first.
    import lmdb

    path = tier.path  # type: ignore[attr-defined]
    tier.close()
    env = lmdb.open(path, max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        txn.put(KEY.encode(), bad)
    env.close()
    return make_tier()


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_values_are_detected_never_returned(
    make_tier: MakeTier, tier_kind: str, corruption: str
) -> None:
    if tier_kind == "host":
        pytest.skip("host memory has no backend to plant into behind the tier's back")
    tier = make_tier()
    good = encode_block(PAYLOAD, META)
    tier.put_many([(KEY, good)])
    assert read_through_codec(tier, KEY) == "ok"
    corrupt, reason = CORRUPTIONS[corruption]
    tier = plant(tier_kind, make_tier, tier, corrupt(good))
    seen = read_through_codec(tier, KEY)
    # A truncated S3 range read is already a miss inside the tier; everything else reaches the
    # codec, which must name the exact problem.
    assert seen == reason or (tier_kind == "s3" and corruption == "truncated" and seen == "miss")


def test_redis_killed_and_restarted_tier_recovers(redis_server: RedisServer, redis_url: str) -> None:
    if not redis_server.managed:
        pytest.skip("external Redis: cannot kill it")
    tier = RedisTier(RedisTierConfig(url=redis_url, retries=0))
    good = encode_block(PAYLOAD, META)
    tier.put_many([(KEY, good)])
    redis_server.kill()
    with pytest.raises(TierError):
        tier.get_many([KEY])
    with pytest.raises(TierError):
        tier.put_many([(KEY, good)])
    redis_server.start()
    assert read_through_codec(tier, KEY) == "miss"  # no persistence: restarted empty
    tier.put_many([(KEY, good)])
    assert read_through_codec(tier, KEY) == "ok"
    tier.close()


def test_s3_killed_and_restarted_tier_recovers(s3_server: S3Server, s3_config: dict) -> None:
    if not s3_server.managed:
        pytest.skip("external S3: cannot kill it")
    from tiers.s3 import S3Tier, S3TierConfig

    fields = {k: v for k, v in s3_config.items() if k != "kind"}
    tier = S3Tier(S3TierConfig(**fields, max_attempts=1))
    good = encode_block(PAYLOAD, META)
    tier.put_many([(KEY, good)])
    s3_server.kill()
    with pytest.raises(TierError):
        tier.lookup([KEY])
    with pytest.raises(TierError):
        tier.put_many([(KEY, good)])
    s3_server.start()  # moto restarts empty: the bucket is gone too
    s3_server.create_bucket(fields["bucket"])  # type: ignore[arg-type]
    assert read_through_codec(tier, KEY) == "miss"
    tier.put_many([(KEY, good)])
    assert read_through_codec(tier, KEY) == "ok"
    tier.close()
