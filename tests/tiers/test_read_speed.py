"""Each tier's batched read against the best plain use of its medium, measured in this process
with the functions of bench/tiers.py (median of 5 interleaved passes).

The bench targets (quiet machine) are LMDB >= 0.7x a plain read transaction on the tier's own
environment, Redis >= 0.8x raw pipelined redis-py at the tier's ``read_connections``, S3 (moto)
>= 0.8x raw boto3 at the tier's concurrency. CI machines are shared and noisy, so these tests
assert 0.5x: they catch a read path that lost its way (a lock, a copy per page fault, a
request per key), not a few percent.
"""

from __future__ import annotations

from bench.tiers import lmdb_backend, read_ratios, redis_backend, s3_backend
from tests.servers import S3Server
from tests.tiers.conftest import MIB

MARGIN = 0.5


def check(name: str, ratios: dict) -> None:
    for op in ("get", "get_into"):
        assert ratios[op] >= MARGIN, f"{name} {op}: {ratios[op]:.2f}x its baseline; {ratios['runs']}"


def test_lmdb_reads_at_the_speed_of_a_plain_read_transaction() -> None:
    # 96 page-cached 2 MiB blocks in one call, as a long prefix reload asks for them.
    check("lmdb", read_ratios(lmdb_backend, 2 * MIB, 96))


def test_redis_reads_at_the_speed_of_raw_pipelined_gets(redis_url: str) -> None:
    check("redis", read_ratios(redis_backend(redis_url), 2 * MIB, 32))


def test_s3_reads_at_the_speed_of_raw_boto3(s3_server: S3Server) -> None:
    check("s3", read_ratios(s3_backend(s3_server.endpoint_url, s3_server.credentials()),
                            2 * MIB, 32))
