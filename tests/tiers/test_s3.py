"""S3 tier specifics (the shared behaviour is in test_contract.py): the grouped object layout,
request counts for long chains, misaligned writes, damaged or expired objects, errors."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.servers import S3Server
from tiers.base import TierError
from tiers.s3 import S3Tier, S3TierConfig


def keys_of(n: int, start: int = 0) -> list[str]:
    return [f"ns/{i:04d}" for i in range(start, start + n)]


def val(key: str) -> bytes:
    return key.encode() * 7


@pytest.fixture
def tier(s3_config: dict[str, Any]) -> Iterator[S3Tier]:
    fields = {k: v for k, v in s3_config.items() if k != "kind"}
    t = S3Tier(S3TierConfig(**fields, blocks_per_object=16))
    yield t
    t.close()


class RequestLog:
    """Counts HTTP requests the tier's boto3 client sends, by operation name."""

    def __init__(self, tier: S3Tier) -> None:
        self.ops: list[str] = []
        tier._s3.meta.events.register("before-send.s3", self._record)

    def _record(self, request: Any, **_: Any) -> None:
        self.ops.append(request.method + (" range" if "Range" in request.headers else ""))

    def take(self) -> list[str]:
        ops, self.ops = sorted(self.ops), []
        return ops


def test_s3_fixture_bucket_roundtrip(s3_server: S3Server, s3_bucket: str) -> None:
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="a/b", Body=b"xyz")
    assert client.get_object(Bucket=s3_bucket, Key="a/b")["Body"].read() == b"xyz"
    other = s3_server.create_bucket()
    assert client.list_objects_v2(Bucket=other).get("KeyCount") == 0
    s3_server.delete_bucket(other)


def test_layout_is_one_object_per_group_plus_pointers(
    tier: S3Tier, s3_server: S3Server, s3_bucket: str
) -> None:
    keys = keys_of(40)
    tier.put_many([(k, val(k)) for k in keys])
    listing = s3_server.client().list_objects_v2(Bucket=s3_bucket, Prefix="kv/")["Contents"]
    names = [o["Key"] for o in listing]
    groups = [o for o in listing if o["Key"].startswith("kv/g/")]
    assert len(groups) == 3  # 16 + 16 + 8
    assert sorted(o["Size"] for o in groups) == sorted([16 * 49, 16 * 49, 8 * 49])
    assert sorted(n for n in names if n.startswith("kv/k/")) == [f"kv/k/{k}" for k in keys]


def test_long_chain_costs_one_request_per_group(tier: S3Tier) -> None:
    keys = keys_of(64)
    tier.put_many([(k, val(k)) for k in keys])
    log = RequestLog(tier)
    assert tier.lookup(keys) == 64
    assert log.take() == ["GET"] * 4  # one pointer per group of 16
    assert tier.lookup(keys + keys_of(6, start=100)) == 64
    assert log.take() == ["GET"] * 5  # the fifth finds the miss
    got = tier.get_many(keys)
    assert [bytes(v) for v in got] == [val(k) for k in keys]  # type: ignore[arg-type]
    assert log.take() == ["GET"] * 4 + ["GET range"] * 4


def test_a_put_many_is_two_rounds_of_parallel_requests_deep(tier: S3Tier) -> None:
    """Every request waits ``delay`` before it is sent (a remote endpoint's round trip, in the
    sending thread): 32 blocks (2 groups + 32 pointers) take about two delays, where one
    pointer after another behind each group took 1 + 16."""
    delay = 0.2

    def slow(**_: Any) -> None:
        time.sleep(delay)

    tier._s3.meta.events.register("before-send.s3", slow)
    keys = keys_of(32)
    log = RequestLog(tier)
    start = time.monotonic()
    tier.put_many([(k, val(k)) for k in keys])
    elapsed = time.monotonic() - start
    assert log.take() == ["PUT"] * 34
    assert elapsed < 8 * delay, f"put_many took {elapsed:.2f} s: requests in sequence"
    assert [bytes(v) for v in tier.get_many(keys)] == [val(k) for k in keys]  # type: ignore[arg-type]


def test_chains_written_in_misaligned_calls_still_resolve(tier: S3Tier) -> None:
    keys = keys_of(45)
    tier.put_many([(k, val(k)) for k in keys[:10]])
    tier.put_many([(k, val(k)) for k in keys[10:45]])
    assert tier.lookup(keys) == 45
    assert tier.lookup(keys[5:30]) == 25
    got = tier.get_many(keys[::-1])
    assert [bytes(v) for v in got] == [val(k) for k in keys[::-1]]  # type: ignore[arg-type]


def test_expired_group_or_damaged_pointer_is_a_miss(
    tier: S3Tier, s3_server: S3Server, s3_bucket: str
) -> None:
    keys = keys_of(4)
    tier.put_many([(k, val(k)) for k in keys[:2]])
    tier.put_many([(k, val(k)) for k in keys[2:]])
    client = s3_server.client()
    pointer = client.get_object(Bucket=s3_bucket, Key=f"kv/k/{keys[2]}")["Body"].read()
    client.put_object(Bucket=s3_bucket, Key=f"kv/k/{keys[0]}", Body=b"\xc1 not msgpack")
    import msgpack

    client.delete_object(Bucket=s3_bucket, Key=msgpack.unpackb(pointer)["g"])
    assert tier.lookup(keys) == 0
    assert tier.get_many(keys) == [None, tier.get_many([keys[1]])[0], None, None]
    assert bytes(tier.get_many([keys[1]])[0]) == val(keys[1])  # type: ignore[arg-type]


def test_dead_endpoint_raises_tier_error(s3_server: S3Server, s3_bucket: str) -> None:
    if not s3_server.managed:
        pytest.skip("external S3 endpoint: cannot stop it")
    tier = S3Tier(
        S3TierConfig(
            bucket=s3_bucket,
            endpoint_url=s3_server.endpoint_url,
            access_key_id="a",
            secret_access_key="b",
            max_attempts=1,
        )
    )
    s3_server.kill()
    try:
        start = time.monotonic()
        for op in (
            lambda: tier.lookup(["x"]),
            lambda: tier.get_many(["x"]),
            lambda: tier.put_many([("x", b"1")]),
            lambda: tier.delete_many(["x"]),
            tier.usage,
        ):
            with pytest.raises(TierError):
                op()
        assert time.monotonic() - start < 5.0
    finally:
        s3_server.start()
        tier.close()


def test_config_checks_and_secret_free_repr() -> None:
    cfg = S3TierConfig(bucket="b", access_key_id="AKIA", secret_access_key="topsecret")
    assert "topsecret" not in repr(cfg) and "AKIA" not in repr(cfg)
    with pytest.raises(ValueError, match="both"):
        S3TierConfig(bucket="b", access_key_id="AKIA")
    with pytest.raises(ValueError, match="blocks_per_object"):
        S3TierConfig(bucket="b", blocks_per_object=0)
