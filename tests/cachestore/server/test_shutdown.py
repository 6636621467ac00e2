"""``kvtier cache-server`` shutdown: a SIGTERM to its whole process group (as a supervisor sends
it) drains, the exit code is 0 only after a clean drain, and a restarted daemon on the same
data directory serves every acknowledged block; a drain that outlives ``drain_timeout_s`` is
reported (``CacheServer.drain_problem``), which makes the command exit 1."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cachestore.server.daemon import CacheServer, ServerConfig
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from tests.cachestore.server.daemon_procs import start_daemon
from tests.cachestore.store_helpers import sized_block
from tests.servers import free_port
from tiers.base import TierError
from tiers.lmdb import LmdbTier
from tiers.remote.tier import RemoteTier

KEYS = [f"ns/{i:02x}" for i in range(24)]


def _start(data_dir: Path) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    proc = start_daemon(
        *("--port", str(port), "--admin-port", "-1", "--data-dir", str(data_dir)),
        *("--lmdb-capacity", "64MiB", "--host-capacity", "4MiB", "--host-slot-bytes", "64KiB"),
        expect="listening on",
        start_new_session=True,  # its own process group, as under a supervisor
    )
    return proc, port


def _stop_group(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


def test_group_sigterm_drains_exits_0_and_a_restart_serves_every_block(tmp_path: Path) -> None:
    proc, port = _start(tmp_path)
    try:
        tier = RemoteTier(f"tcp://127.0.0.1:{port}", timeout_s=5)
        tier.put_many([(k, sized_block(k, 3000)) for k in KEYS])
        tier.close()
    finally:
        code, out, err = _stop_group(proc)
    assert code == 0, err
    assert "stopped (drained)" in out, out
    proc, port = _start(tmp_path)
    try:
        tier = RemoteTier(f"tcp://127.0.0.1:{port}", timeout_s=5)
        got = tier.get_many(KEYS)
        tier.close()
    finally:
        _stop_group(proc)
    assert [bytes(v) if v is not None else None for v in got] == [
        sized_block(k, 3000) for k in KEYS
    ]


def test_sigusr1_dumps_the_daemons_stacks_and_it_serves_on(tmp_path: Path) -> None:
    proc, port = _start(tmp_path)
    try:
        tier = RemoteTier(f"tcp://127.0.0.1:{port}", timeout_s=5)
        tier.put_many([(k, sized_block(k, 3000)) for k in KEYS[:4]])
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(0.3)
        got = tier.get_many(KEYS[:4])  # still serving
        tier.close()
    finally:
        code, _, err = _stop_group(proc)
    assert [bytes(v) for v in got] == [sized_block(k, 3000) for k in KEYS[:4]]
    assert code == 0, err
    assert "Thread 0x" in err and "cachestore/server" in err, err


class _SlowLmdb(LmdbTier):
    """LMDB whose writes take ``delay_s`` (a slow disk), to keep a put in flight."""

    delay_s = 1.5

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.writing = threading.Event()  # a put reached the tier

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> object:  # type: ignore[override]
        self.writing.set()
        time.sleep(self.delay_s)
        return super().put_many(items)


def test_a_drain_past_its_timeout_is_reported(tmp_path: Path) -> None:
    slow = _SlowLmdb(tmp_path / "lmdb", 64 << 20)
    store = HierarchicalStore([slow], StoreConfig())
    server = CacheServer(ServerConfig(url="tcp://127.0.0.1:0", drain_timeout_s=0.2), store)
    server.start()
    # the put's reply never comes (the server stops under it): its timeout ends the thread
    tier = RemoteTier(
        server.bound_url, timeout_s=3, use_shm=False, use_doorbell=False, use_stream=False
    )

    def put_one() -> None:
        with contextlib.suppress(TierError):  # the server stops under it: no reply comes
            tier.put_many([("ns/01", sized_block("ns/01", 500))])

    try:
        put = threading.Thread(target=put_one)
        put.start()
        # The put itself in flight (not any request: a connection's first exchange also
        # counts in ``inflight``, and stopping on that one let the put arrive too late).
        assert slow.writing.wait(5)
        assert server.inflight >= 1
        server.request_stop()
        assert server.wait(10)
        put.join(10)
    finally:
        tier.close()
        server.stop()
        store.close()
    assert server.drain_problem is not None
    assert "1 requests still in flight after drain_timeout_s (0.2 s)" in server.drain_problem
    assert not put.is_alive()


def test_a_clean_drain_reports_nothing(tmp_path: Path) -> None:
    store = HierarchicalStore([LmdbTier(tmp_path / "lmdb", 64 << 20)], StoreConfig())
    server = CacheServer(ServerConfig(url="tcp://127.0.0.1:0"), store).start()
    tier = RemoteTier(server.bound_url, timeout_s=5, use_shm=False)
    try:
        tier.put_many([("ns/01", sized_block("ns/01", 500))])
    finally:
        tier.close()
        server.stop()
        store.close()
    assert server.wait(0) and server.drain_problem is None
