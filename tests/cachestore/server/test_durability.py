"""R5: SIGKILL mid-put, restart on the same --data-dir: every acknowledged block is served,
and no block is ever partial or corrupt (in-flight ones are either whole or absent)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

from tests.cachestore.server.daemon_procs import start_daemon
from tests.cachestore.store_helpers import sized_block
from tests.servers import free_port
from tiers.base import TierError
from tiers.remote.tier import RemoteTier


def _start(port: int, data_dir: Path) -> subprocess.Popen[str]:
    return start_daemon(
        *("--port", str(port), "--admin-port", "-1", "--data-dir", str(data_dir)),
        *("--lmdb-capacity", "256MiB", "--host-capacity", "8MiB", "--host-slot-bytes", "300KiB"),
        stderr=False,
    )


def test_sigkill_mid_put_keeps_every_acknowledged_block(tmp_path: Path) -> None:
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    proc = _start(port, tmp_path)
    acked: list[str] = []
    attempted: list[str] = []
    lock = threading.Lock()
    started = threading.Barrier(4)

    def writer(w: int) -> None:
        # Writers 0 and 1 send frames, 2 the same-host shared-memory path.
        tier = RemoteTier(url, timeout_s=3, use_shm=w == 2, retry_interval_s=10)
        started.wait()
        try:
            for n in range(100_000):
                keys = [f"w{w}/{n:06d}{j:02d}" for j in range(4)]
                size = 256 << 10 if n % 2 else 48 << 10
                with lock:
                    attempted.extend(keys)
                tier.put_many([(k, sized_block(k, size)) for k in keys])
                with lock:
                    acked.extend(keys)
        except TierError:
            pass  # the daemon died under us: stop writing
        finally:
            tier.close()

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    started.wait()
    deadline = time.monotonic() + 30
    while len(acked) < 300 and time.monotonic() < deadline:  # a stream is flowing
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    for t in threads:
        t.join(30)
    assert len(acked) >= 300
    in_flight = sorted(set(attempted) - set(acked))

    proc = _start(port, tmp_path)
    try:
        tier = RemoteTier(url, timeout_s=10)
        got = tier.get_many(acked)
        missing = [k for k, v in zip(acked, got, strict=True) if v is None]
        assert missing == []
        for key, value in zip(acked, got, strict=True):
            assert value is not None
            assert bytes(value) == sized_block(key, len(value)) and len(value) in (
                48 << 10,
                256 << 10,
            )
        for key, value in zip(in_flight, tier.get_many(in_flight), strict=True):
            if value is not None:  # committed before the kill but not acknowledged: whole
                assert bytes(value) == sized_block(key, len(value))
                assert len(value) in (48 << 10, 256 << 10)
        tier.close()
    finally:
        proc.terminate()
        proc.wait(30)
