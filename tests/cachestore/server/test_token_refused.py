"""A token the daemon does not know is reported as such at both ends (user audit): the
client's error says the token was refused (at once, not "not reachable" at its timeout), the
store's log of the failing ``remote`` tier says so too, and the daemon logs one WARNING per
refusing address (never the token) and counts every refusal in ``/metrics`` and ``/stats``.
A daemon process started by the CLI, clients in this process."""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from tests.cachestore.server.daemon_procs import start_daemon
from tests.servers import free_port, python_env
from tiers.base import TierError
from tiers.config import RemoteTierConfig
from tiers.remote.tier import RemoteTier

pytestmark = pytest.mark.timeout(120)
TOKEN = "tok-alice-0001"
WRONG = "tok-mallory-99"


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[str, str, subprocess.Popen[str]]]:
    """(ZMQ url, admin base url, the process) of a daemon with one tenant; stderr piped."""
    (tmp_path / "tokens").write_text(f"{TOKEN} alice\n")
    port, admin = free_port(), free_port()
    proc = start_daemon(
        *("--port", str(port), "--admin-port", str(admin), "--host-capacity", "16MiB"),
        *("--tokens", str(tmp_path / "tokens"), "--no-stream", "--no-shm"),
        env=python_env(),
    )
    base = f"http://127.0.0.1:{admin}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"{base}/health", timeout=1)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline and proc.poll() is None, "admin port never up"
            time.sleep(0.1)
    try:
        yield f"tcp://127.0.0.1:{port}", base, proc
    finally:
        proc.terminate()
        proc.wait(30)


def _refusal(tier: RemoteTier) -> tuple[str, float]:
    """The TierError of one lookup through ``tier``, and how long it took."""
    t0 = time.monotonic()
    with pytest.raises(TierError) as err:
        tier.lookup(["ns/aa"])
    return str(err.value), time.monotonic() - t0


def test_a_wrong_token_is_refused_not_unreachable(
    daemon: tuple[str, str, subprocess.Popen[str]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, base, proc = daemon
    bad = RemoteTier(url, token=WRONG, timeout_s=5.0, retry_interval_s=0.3, use_shm=False)
    try:
        message, took = _refusal(bad)
        assert message == f"cache server {url}: token refused (authentication failed)"
        assert took < 2.0  # the handshake's refusal, not the 5 s timeout
        message, _ = _refusal(bad)  # failing fast for retry_interval_s: the same reason
        assert message.startswith(f"cache server {url}: token refused") and "retrying" in message
        time.sleep(0.4)
        assert _refusal(bad)[0] == message.split(",")[0]  # a new handshake, refused again
    finally:
        bad.close()
    # The user's setup: an engine's store over a remote tier whose token_file is wrong.
    (tmp_path / "token").write_text(WRONG + "\n")
    tier = RemoteTier.from_config(RemoteTierConfig(url=url, token_file=str(tmp_path / "token")))
    store = HierarchicalStore([tier], StoreConfig())
    try:
        with caplog.at_level(logging.WARNING, logger="cachestore"):
            assert store.lookup(["ns/aa"]).num_blocks == 0  # a miss to the engine
        assert f"tier remote failed: cache server {url}: token refused" in caplog.text
        assert "not reachable" not in caplog.text
        assert store.stats()["tiers"][0]["consecutive_failures"] >= 1  # /health: down
    finally:
        store.close()
    good = RemoteTier(url, token=TOKEN, use_shm=False)
    try:
        assert good.lookup(["ns/aa"]) == 0  # the right token works
    finally:
        good.close()
    assert httpx.get(f"{base}/stats").json()["handshakes_denied"] == 3
    assert "kvtier_server_handshakes_denied_total 3.0" in httpx.get(f"{base}/metrics").text
    proc.terminate()
    _, stderr = proc.communicate(timeout=30)
    refusals = [ln for ln in stderr.splitlines() if "refused" in ln]
    assert len(refusals) == 1, stderr  # one WARNING for the address, however many refusals
    assert "WARNING" in refusals[0] and "from 127.0.0.1" in refusals[0]
    assert "token not in --tokens" in refusals[0]
    assert WRONG not in stderr


def test_no_daemon_is_still_not_reachable() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    tier = RemoteTier(url, token=WRONG, timeout_s=0.5, use_shm=False)
    try:
        assert _refusal(tier)[0] == f"cache server {url} not reachable"
    finally:
        tier.close()
