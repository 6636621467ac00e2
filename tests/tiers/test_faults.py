"""Faults: corrupt values planted directly in each backend, and backends that die and return.

Corrupt values are written behind the tier's back — with the ``lmdb`` module, redis-py ``SET``
and boto3 ``put_object`` — then read through the tier and the codec: every one must be a miss
(``None`` from the tier) or a ``CodecError`` with the expected reason, never a decoded block.

The same plants read through ``cachestore.store.hierarchical.HierarchicalStore`` are misses with the
store's ``corrupt`` counter raised and the bad values deleted. With redis-server SIGKILLed and
the S3 server stopped mid-test, store reads miss and demotions are skipped, counted as errors,
never raised; after both restart, the tiers are probed again once the backoff is over (a fake
clock makes that exact) and reads hit.
"""

from __future__ import annotations

from collections.abc import Callable

import msgpack
import pytest

from cachestore.codec import BlockMeta, CodecError, decode_block, encode_block, encode_block_into
from cachestore.hashing import Namespace
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from tests.cachestore.store_helpers import FakeClock, counters
from tests.servers import RedisServer, S3Server
from tests.tiers.conftest import MakeTier
from tiers.base import Tier, TierError
from tiers.host import HostTier
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


def plant(kind: str, make_tier: MakeTier, tier: Tier, bad: bytes, key: str = KEY) -> Tier:
    """Overwrite ``key`` (written alone by one ``put_many``) with ``bad`` directly in the
    backend; return a tier to read it with (for lmdb a new one: the old one is closed)."""
    if kind == "redis":
        import redis

        raw = redis.Redis.from_url(tier.config.url)  # type: ignore[attr-defined]
        raw.set(tier.config.key_prefix + key, bad)  # type: ignore[attr-defined]
        raw.close()
        return tier
    if kind == "s3":
        s3 = tier._s3  # type: ignore[attr-defined]  # the same endpoint and credentials
        bucket, prefix = tier.config.bucket, tier.config.prefix  # type: ignore[attr-defined]
        pointer = msgpack.unpackb(
            s3.get_object(Bucket=bucket, Key=f"{prefix}k/{key}")["Body"].read()
        )
        s3.put_object(Bucket=bucket, Key=pointer["g"], Body=bad)
        if len(bad) != pointer["n"][0]:  # keep the manifest honest about the planted length
            pointer["n"] = [len(bad)]
            s3.put_object(Bucket=bucket, Key=f"{prefix}k/{key}", Body=msgpack.packb(pointer))
        return tier
    # lmdb: one process may not open an environment twice, so close the tier first.
    import lmdb

    path = tier.path  # type: ignore[attr-defined]
    tier.close()
    env = lmdb.open(path, max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        txn.put(key.encode(), bad)
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


def _kill_restart_recover(
    tier: Tier, kill: Callable[[], None], restart: Callable[[], None], read_op: Callable[[], object]
) -> None:
    """A backend killed under the tier: ``read_op`` and a put raise TierError; restarted
    (empty), the old key is a miss and a new put reads back through the codec."""
    good = encode_block(PAYLOAD, META)
    tier.put_many([(KEY, good)])
    kill()
    with pytest.raises(TierError):
        read_op()
    with pytest.raises(TierError):
        tier.put_many([(KEY, good)])
    restart()
    assert read_through_codec(tier, KEY) == "miss"
    tier.put_many([(KEY, good)])
    assert read_through_codec(tier, KEY) == "ok"
    tier.close()


def test_redis_killed_and_restarted_tier_recovers(
    redis_server: RedisServer, redis_url: str
) -> None:
    if not redis_server.managed:
        pytest.skip("external Redis: cannot kill it")
    tier = RedisTier(RedisTierConfig(url=redis_url, retries=0))
    # No persistence: the restarted server is empty.
    _kill_restart_recover(tier, redis_server.kill, redis_server.start, lambda: tier.get_many([KEY]))


def test_s3_killed_and_restarted_tier_recovers(s3_server: S3Server, s3_config: dict) -> None:
    if not s3_server.managed:
        pytest.skip("external S3: cannot kill it")
    from tiers.s3 import S3Tier, S3TierConfig

    fields = {k: v for k, v in s3_config.items() if k != "kind"}
    tier = S3Tier(S3TierConfig(**fields, max_attempts=1))

    def restart() -> None:
        s3_server.start()  # moto restarts empty: the bucket is gone too
        s3_server.create_bucket(fields["bucket"])  # type: ignore[arg-type]

    _kill_restart_recover(tier, s3_server.kill, restart, lambda: tier.lookup([KEY]))


# -- through the hierarchical store ---------------------------------------------------------

SLOT = len(encode_block(PAYLOAD, META))


def store_keys(n: int, salt: int = 0) -> list[str]:
    return [f"{NS}/{salt:08x}{i:056x}" for i in range(n)]


def test_store_reads_of_corrupt_values_are_misses(make_tier: MakeTier, tier_kind: str) -> None:
    """Every corruption planted in LMDB, Redis or S3 under a host tier: a miss counted as
    ``corrupt`` and deleted there; the one good block beside them decodes exactly."""
    if tier_kind == "host":
        pytest.skip("host memory has no backend to plant into behind the tier's back")
    names = sorted(CORRUPTIONS)
    keys = store_keys(len(names) + 1)
    good = encode_block(PAYLOAD, META)
    lower = make_tier()
    for key in keys:
        lower.put_many([(key, good)])  # one call per key: on S3, one group object per key
    for name, key in zip(names, keys, strict=False):
        lower = plant(tier_kind, make_tier, lower, CORRUPTIONS[name][0](good), key)
    store = HierarchicalStore([HostTier(4 * SLOT, SLOT), lower], StoreConfig(namespace=NS))
    got = store.get_many(keys)
    assert got[:-1] == [None] * len(names)
    assert got[-1] is not None and bytes(got[-1]) == PAYLOAD
    assert counters(store, "corrupt") == [0, len(names)]
    assert counters(store, "hits") == [0, 1] and counters(store, "misses") == [len(keys), 5]
    assert counters(store, "errors") == [0, 0]
    assert [lower.lookup([k]) for k in keys] == [0] * len(names) + [1]  # bad values deleted
    assert store.get_many(keys[:-1]) == [None] * len(names)  # now plain misses, not corrupt
    assert counters(store, "corrupt") == [0, len(names)]
    store.flush()
    assert store.tiers[0].lookup(keys[-1:]) == 1  # the good block was promoted
    store.close()


def test_store_survives_redis_killed_and_s3_stopped_then_recovers(
    redis_server: RedisServer,
    s3_server: S3Server,
    redis_config: dict,
    s3_config: dict,
) -> None:
    if not (redis_server.managed and s3_server.managed):
        pytest.skip("external servers: cannot kill them")
    from tiers import build_tiers
    from tiers.config import parse_tier_config

    clock = FakeClock(1000.0)
    backoff_s = 0.5
    cfg = parse_tier_config(
        {
            "tiers": [
                {"kind": "host", "capacity": f"{2 * SLOT}B", "slot_bytes": f"{SLOT}B"},
                {
                    **redis_config,
                    "capacity": f"{2 * SLOT}B",
                    "retries": 0,
                    "socket_timeout_s": 1.0,
                    "connect_timeout_s": 0.5,
                },
                {**s3_config, "max_attempts": 1, "connect_timeout_s": 0.5, "timeout_s": 2.0},
            ]
        }
    )
    store = HierarchicalStore(
        build_tiers(cfg),
        StoreConfig(namespace=NS, backoff_initial_s=backoff_s, backoff_max_s=backoff_s),
        clock=clock,
    )
    host, redis_tier, s3_tier = store.tiers
    keys = store_keys(12, salt=1)
    payloads = [bytes([i]) * len(PAYLOAD) for i in range(12)]
    blocks = [encode_block(p, META) for p in payloads]

    def put(i: int) -> None:
        assert store.put_many([(keys[i], blocks[i])]) == 1  # the host write always succeeds

    for i in range(6):
        put(i)
    store.flush()
    assert host.lru_keys() == keys[4:6]  # type: ignore[attr-defined]
    assert redis_tier.lookup(keys[2:4]) == 2 and s3_tier.lookup(keys[:2]) == 2
    assert counters(store, "evictions") == [4, 2, 0]

    redis_server.kill()
    s3_server.stop()
    try:
        assert store.get_many(keys[:4]) == [None] * 4  # both lower tiers fail: misses
        assert counters(store, "errors") == [0, 1, 1]
        assert store.lookup(keys[:6]).num_blocks == 0  # backing off: skipped, not retried
        assert counters(store, "errors") == [0, 1, 1]
        assert counters(store, "skipped") == [0, 1, 1]
        put(6)  # host evicts keys[4]: Redis and S3 back off, the demotion falls off the bottom
        store.flush()
        assert counters(store, "skipped") == [0, 2, 2]
        assert counters(store, "dropped_at_bottom") == [0, 0, 1]
        clock.now += backoff_s  # backoff over: the next demotion probes both and fails both
        put(7)
        store.flush()
        assert counters(store, "errors") == [0, 2, 2] and counters(store, "skipped") == [0, 2, 2]
        assert counters(store, "dropped_at_bottom") == [0, 0, 2]
        got = store.get_many(keys[6:8])  # in host: no lower tier asked
        assert [bytes(v) for v in got if v is not None] == payloads[6:8]
    finally:
        redis_server.start()
        s3_server.start()
    s3_server.create_bucket(s3_config["bucket"])  # moto restarts empty, bucket included
    clock.now += backoff_s
    # Probes succeed: both servers restarted empty, so a miss, and the failure streaks reset.
    assert store.get_many(keys[2:3]) == [None]
    assert [row["consecutive_failures"] for row in store.stats()["tiers"]] == [0, 0, 0]
    for i in range(8, 12):  # host evicts 6..9: Redis takes them and passes 6, 7 on to S3
        put(i)
    store.flush()
    assert redis_tier.lookup(keys[8:10]) == 2 and s3_tier.lookup(keys[6:8]) == 2
    assert counters(store, "hits") == [2, 0, 0]  # keys[6:8] from host while the servers were down
    got = store.get_many([keys[6], keys[8]])
    assert [bytes(v) for v in got if v is not None] == [payloads[6], payloads[8]]
    assert counters(store, "hits") == [2, 1, 1] and counters(store, "errors") == [0, 2, 2]
    store.close()
