"""Shared test configuration: the `gpu` marker, and real Redis / S3 servers as fixtures.

Server fixtures (session scope, started on first use, killed at session end):

- ``redis_server``: ``tests.servers.RedisServer`` (``.url``, ``.start()``, ``.stop()``,
  ``.kill()``, ``.flush()``, ``.client()``), or an external server from KVTIER_TEST_REDIS_URL.
- ``s3_server``: ``tests.servers.S3Server`` (``.endpoint_url``, ``.credentials()``,
  ``.client()``, ``.create_bucket()``, ``.start()``, ``.stop()``, ``.kill()``), or an external
  endpoint from KVTIER_TEST_S3_ENDPOINT (keys from KVTIER_TEST_S3_ACCESS_KEY /
  KVTIER_TEST_S3_SECRET_KEY, else boto3's usual chain).

``--server-soak-s`` (or KVTIER_SERVER_SOAK_S, read here only) sets the cache-server soak
test's duration through the ``server_soak_s`` fixture.

Function-scoped helpers give each test a clean slate: ``redis_url`` (server running and
flushed), ``s3_bucket`` (a fresh empty bucket, deleted afterwards). External servers have
``managed == False``; tests that stop or kill servers skip on them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.servers import ExternalRedis, ExternalS3, RedisServer, S3Server


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--server-soak-s",
        type=float,
        default=float(os.environ.get("KVTIER_SERVER_SOAK_S", "5")),
        help="seconds the cache-server soak test runs (env KVTIER_SERVER_SOAK_S)",
    )


@pytest.fixture(scope="session")
def server_soak_s(pytestconfig: pytest.Config) -> float:
    """Duration of the cache-server soak test: ``--server-soak-s`` (default 5 s)."""
    return float(pytestconfig.getoption("--server-soak-s"))


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch intra-op thread for a test module: tiny matmuls on a shared 2-core machine only
    contend with more, and timings stay steadier. Restores the previous count afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer | ExternalRedis]:
    """A running Redis for the whole session (own redis-server unless KVTIER_TEST_REDIS_URL)."""
    pytest.importorskip("redis", reason="redis-py not installed (pip install kvtier[redis])")
    external = os.environ.get("KVTIER_TEST_REDIS_URL")
    server: RedisServer | ExternalRedis
    if external:
        server = ExternalRedis(external)
    else:
        if not os.path.exists("/usr/bin/redis-server"):
            pytest.skip("redis-server not found at /usr/bin/redis-server")
        server = RedisServer()
        server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A running S3 endpoint for the whole session (moto unless KVTIER_TEST_S3_ENDPOINT)."""
    pytest.importorskip("boto3", reason="boto3 not installed (pip install kvtier[s3])")
    external = os.environ.get("KVTIER_TEST_S3_ENDPOINT")
    server: S3Server
    if external:
        server = ExternalS3(
            external,
            os.environ.get("KVTIER_TEST_S3_ACCESS_KEY"),
            os.environ.get("KVTIER_TEST_S3_SECRET_KEY"),
        )
    else:
        pytest.importorskip("moto.server", reason="moto[server] not installed")
        server = S3Server()
        server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def redis_url(redis_server: RedisServer | ExternalRedis) -> str:
    """The session Redis, running (restarted if a previous test stopped it) and flushed."""
    redis_server.ensure_running()
    redis_server.flush()
    return redis_server.url


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[str]:
    """A fresh empty bucket on the session S3 server (restarted if a test stopped it)."""
    s3_server.ensure_running()
    bucket = s3_server.create_bucket()
    yield bucket
    if s3_server.running:
        s3_server.delete_bucket(bucket)


@pytest.fixture
def s3_config(s3_server: S3Server, s3_bucket: str) -> dict[str, object]:
    """A tier-config dict (``{"kind": "s3", ...}``) for a fresh bucket on the session server.

    Field names are those of ``tiers.s3.S3TierConfig`` / the ``s3`` kind in ``tiers.config``.
    """
    creds = s3_server.credentials()
    config: dict[str, object] = {
        "kind": "s3",
        "endpoint_url": s3_server.endpoint_url,
        "bucket": s3_bucket,
        "prefix": "kv/",
        "region": creds["region_name"],
    }
    if "aws_access_key_id" in creds:
        config["access_key_id"] = creds["aws_access_key_id"]
        config["secret_access_key"] = creds["aws_secret_access_key"]
    return config


@pytest.fixture
def redis_config(redis_url: str) -> dict[str, object]:
    """A tier-config dict (``{"kind": "redis", "url": ...}``) for the flushed session Redis."""
    return {"kind": "redis", "url": redis_url}
