"""``--engine-stall-timeout``: an engine core that lives but says nothing (here SIGSTOP, as one
stuck in a CUDA call would) is treated as dead. Within the timeout and a few seconds a stream
in flight ends with an error event naming the stall and ``[DONE]``, a new request gets 503,
``/health`` 503 (or the server is gone), and ``kvtier serve`` kills the core and exits 1 with
one line saying it stalled and for how long, so that a supervisor restarts it. Before, /health
stayed 200 on the cached stats, requests hung and the server never exited.

And what is not a stall: an idle server (its core sends stats only every 5 s, so a 2 s timeout
relies on the API process asking for them) and both processes stopped and resumed (Ctrl-Z and
``fg``, ``docker pause``) stay up past several timeouts.

A tiny random model on CPU with a 32K context, so that a stream runs for tens of seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.engine.hf_models import make_tiny_model
from tests.engine.server.test_group_sigterm import (
    PROMPTS,
    complete,
    engine_core_pid,
    offload_config,
    start_serve,
    stop_group,
)
from tests.engine.server.test_shutdown_timeout import Stream
from tests.engine.test_core_proc import _gone

pytestmark = pytest.mark.timeout(180)
STALL_TIMEOUT_S = 3
MARGIN_S = 3.0  # the watch's tick, the HTTP reply, a loaded CI machine


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(
        tmp_path_factory.mktemp("engine_stall"), "llama", seed=33, max_position_embeddings=32768
    )


def test_a_stopped_core_fails_requests_and_serve_exits_1_naming_the_stall(
    long_model_dir: str, tmp_path: Path
) -> None:
    proc, base = start_serve(
        long_model_dir,
        tmp_path,
        offload_config(tmp_path / "lmdb"),
        "--engine-stall-timeout",
        str(STALL_TIMEOUT_S),
        "--num-gpu-blocks",
        "2000",  # 32000 tokens: the stream fits
    )
    core = engine_core_pid(proc.pid)
    try:
        stream = Stream(base)
        assert stream.going.wait(60) and stream.error is None, stream.error
        os.kill(core, signal.SIGSTOP)
        stopped_at = time.monotonic()
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4}
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        waited = time.monotonic() - stopped_at
        assert reply.status_code == 503, reply.text
        assert "engine core stalled" in reply.json()["error"]["message"], reply.text
        assert waited < STALL_TIMEOUT_S + MARGIN_S, waited
        try:  # the server may already be on its way out
            health = httpx.get(f"{base}/health?verbose=1", timeout=5)
        except httpx.TransportError:
            pass
        else:
            assert health.status_code == 503, health.text
            assert "engine core stalled" in health.json()["error"]["message"], health.text
        try:  # it exits by itself: nobody signals it
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("kvtier serve still runs 20 s after its core stalled")
        assert proc.returncode == 1, err
        last = err.strip().splitlines()[-1]
        assert "exiting: engine core stalled: no message from it for 3." in last, last
        assert "killed by signal 9" in last and "--engine-stall-timeout" in last, last
        stream.thread.join(10)
        assert stream.error is None and stream.done, stream.error  # ended in-band, not cut
        (event,) = stream.events
        assert event["type"] == "service_unavailable", event
        assert "engine core stalled" in str(event["message"]), event
        deadline = time.monotonic() + 5
        while not _gone(core):  # killed and reaped on the way out
            assert time.monotonic() < deadline, f"engine core {core} still there"
            time.sleep(0.05)
    finally:
        if not _gone(core):
            os.kill(core, signal.SIGCONT)
            os.kill(core, signal.SIGKILL)
        if proc.poll() is None:
            stop_group(proc, signal.SIGKILL)


def test_an_idle_server_and_a_paused_process_group_are_no_stall(
    long_model_dir: str, tmp_path: Path
) -> None:
    proc, base = start_serve(
        long_model_dir,
        tmp_path,
        offload_config(tmp_path / "lmdb"),
        "--engine-stall-timeout",
        "2",
    )
    try:
        time.sleep(6)  # no probe meanwhile: each /health asks the core for stats
        assert proc.poll() is None
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        # Paused as a cgroup freezer (docker pause) may do it: both processes, the API process
        # thawed first, so that its watch wakes to 5 s without a message before the core can
        # send one. Only the time it watched counts: the core gets most of a timeout.
        core = engine_core_pid(proc.pid)
        os.kill(core, signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(5)
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.3)
        os.kill(core, signal.SIGCONT)
        time.sleep(3)
        assert proc.poll() is None
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        complete(base, PROMPTS[:1])
    finally:
        code, err = stop_group(proc, signal.SIGTERM)
    assert code == 0, err
    assert "stalled" not in err, err
