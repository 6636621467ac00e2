"""``kvtier cache-server`` applies each tier's ``write_policy`` from its tiers file, as the
engine does: below the synchronous LMDB tier, a ``write_through`` Redis gets every put's blocks
at once (counted ``written_through`` in ``/stats`` and ``/metrics``) and a graceful stop drains
what is still queued; a ``write_back`` Redis gets nothing while nothing is evicted. Real
daemon processes, a real redis-server."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cachestore.server.daemon_procs import start_daemon
from tests.cachestore.store_helpers import sized_block
from tests.servers import free_port
from tiers.remote.tier import RemoteTier

redis = pytest.importorskip("redis")

KEYS = [f"ns/{i:02x}" for i in range(48)]  # 48 x 3000 bytes: no tier evicts anything


def _tiers_file(tmp_path: Path, redis_url: str, policy: str) -> Path:
    """host + LMDB + Redis, the Redis tier with ``write_policy: policy``."""
    path = tmp_path / "tiers.yaml"
    path.write_text(
        "tiers:\n"
        "  - {kind: host, capacity: 4MiB, slot_bytes: 64KiB}\n"
        f"  - {{kind: lmdb, path: {tmp_path / 'lmdb'}, capacity: 64MiB}}\n"
        f"  - {{kind: redis, url: '{redis_url}', write_policy: {policy}}}\n"
    )
    return path


@contextmanager
def _daemon(tiers: Path) -> Iterator[tuple[subprocess.Popen[str], int, int, list[str]]]:
    """The daemon over ``tiers``: (process, its port, its admin port, its start-up lines).
    Killed on the way out if the test did not stop it."""
    port, admin = free_port(), free_port()
    proc = start_daemon(
        *("--port", str(port), "--admin-port", str(admin), "--config", str(tiers)),
        start_new_session=True,
    )
    assert proc.stdout is not None
    lines = [proc.stdout.readline() for _ in range(3)]  # the tiers, after the listening line
    try:
        yield proc, port, admin, lines
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _put(port: int) -> None:
    tier = RemoteTier(f"tcp://127.0.0.1:{port}", timeout_s=5)
    try:
        assert tier.put_many([(k, sized_block(k, 3000)) for k in KEYS]) == []  # none evicted
    finally:
        tier.close()


def _stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """SIGTERM (a graceful stop, its drain included); the exit code and stdout."""
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out


def _redis_row(admin: int) -> dict[str, Any]:
    rows = httpx.get(f"http://127.0.0.1:{admin}/stats", timeout=5).json()["store"]["tiers"]
    return next(r for r in rows if r["name"] == "redis")


def test_a_write_through_redis_gets_every_put_and_stats_count_them(
    tmp_path: Path, redis_url: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    with _daemon(_tiers_file(tmp_path, redis_url, "write_through")) as (proc, port, admin, lines):
        assert lines[2].rstrip().endswith(", write_through"), lines
        _put(port)
        deadline = time.monotonic() + 20
        while _redis_row(admin)["written_through"] < len(KEYS):
            assert time.monotonic() < deadline, _redis_row(admin)
            time.sleep(0.05)
        assert _redis_row(admin)["written_through"] == len(KEYS)
        assert client.dbsize() == len(KEYS)
        metrics = httpx.get(f"http://127.0.0.1:{admin}/metrics", timeout=5).text
        assert f'kvtier_store_written_through_total{{tier="redis"}} {len(KEYS)}.0' in metrics
        code, out = _stop(proc)
    assert code == 0 and "stopped (drained)" in out, out


def test_a_graceful_stop_drains_the_write_through_queue(tmp_path: Path, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    with _daemon(_tiers_file(tmp_path, redis_url, "write_through")) as (proc, port, _, _lines):
        _put(port)
        code, out = _stop(proc)  # at once: whatever is still queued is drained before exit
    assert code == 0 and "stopped (drained)" in out, out
    assert client.dbsize() == len(KEYS)


def test_a_write_back_redis_gets_nothing_while_nothing_is_evicted(
    tmp_path: Path, redis_url: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    with _daemon(_tiers_file(tmp_path, redis_url, "write_back")) as (proc, port, admin, lines):
        assert lines[2].rstrip().endswith(", write_back"), lines
        _put(port)
        assert _redis_row(admin)["written_through"] == 0
        code, out = _stop(proc)  # the shutdown flush fills LMDB, which holds them already
    assert code == 0 and "stopped (drained)" in out, out
    assert client.dbsize() == 0
