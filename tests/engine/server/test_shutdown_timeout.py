"""``--shutdown-timeout``: a SIGTERM while a long stream runs stops ``kvtier serve`` within the
timeout, not when the stream's last token is out. At the deadline the stream ends with an error
event saying the server is shutting down, then ``[DONE]`` (not a connection cut mid-stream),
the engine core aborts its request (the request log gets its line, written only when the core
ends a request) and still drains the KV offload, and the exit code is 0.

A tiny random model on CPU with a 32K context streams up to 31K tokens (tens of seconds at a
few hundred tokens a second); the server gets ``--shutdown-timeout 1`` and the SIGTERM once the
stream is going, so the test streams for about two seconds.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.engine.hf_models import make_tiny_model
from tests.engine.server.test_group_sigterm import offload_config, start_serve, stop_group

pytestmark = pytest.mark.timeout(180)
SHUTDOWN_TIMEOUT_S = 1
EXIT_MARGIN_S = 8.0  # the HTTP side's teardown, the KV drain, the core's and the API's exit
MAX_TOKENS = 31_000  # the whole stream: 40 s at this machine's ~800 tokens a second


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(
        tmp_path_factory.mktemp("shutdown_timeout"), "llama", seed=31, max_position_embeddings=32768
    )


class Stream:
    """One streaming /v1/completions read on a thread: ``going`` once 20 chunks came, then
    ``chunks`` and how it ended (``done``: the [DONE] line came; ``events``: in-band error
    events; ``error``: what cut it)."""

    def __init__(self, base: str) -> None:
        self.body = {
            "model": "tiny",
            "prompt": [5, 6, 7],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        self.base = base
        self.chunks = 0
        self.done = False
        self.events: list[dict[str, object]] = []
        self.error: BaseException | None = None
        self.ended_at: float | None = None  # when the in-band error event came
        self.going = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            with httpx.stream(
                "POST", f"{self.base}/v1/completions", json=self.body, timeout=120
            ) as reply:
                for line in reply.iter_lines():
                    self.done = self.done or line == "data: [DONE]"
                    if line.startswith("data: {") and '"error"' in line[:16]:
                        self.events.append(json.loads(line[6:])["error"])
                        self.ended_at = time.monotonic()
                        continue
                    self.chunks += line.startswith("data: {")
                    if self.chunks >= 20:
                        self.going.set()
        except httpx.HTTPError as exc:
            self.error = exc
        finally:
            self.going.set()


def test_sigterm_aborts_a_long_stream_at_the_timeout_and_still_drains(
    long_model_dir: str, tmp_path: Path
) -> None:
    request_log = tmp_path / "requests.jsonl"
    proc, base = start_serve(
        long_model_dir,
        tmp_path,
        offload_config(tmp_path / "lmdb"),
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
        "--num-gpu-blocks",
        "2000",  # 32000 tokens: the whole stream fits
        "--request-log",
        str(request_log),
    )
    stream = Stream(base)
    assert stream.going.wait(60) and stream.error is None, stream.error
    time.sleep(0.5)
    assert not request_log.exists() or request_log.read_text() == ""  # still running
    start = time.monotonic()
    try:
        code, err = stop_group(proc, signal.SIGTERM, timeout_s=SHUTDOWN_TIMEOUT_S + EXIT_MARGIN_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvtier serve still ran {SHUTDOWN_TIMEOUT_S + EXIT_MARGIN_S}s after SIGTERM")
    elapsed = time.monotonic() - start
    stream.thread.join(10)
    assert code == 0, err
    assert SHUTDOWN_TIMEOUT_S <= elapsed < SHUTDOWN_TIMEOUT_S + EXIT_MARGIN_S, elapsed
    # ended at the timeout counted from the signal (the watchdog's 0.5 s poll no longer adds)
    assert stream.ended_at is not None
    assert SHUTDOWN_TIMEOUT_S <= stream.ended_at - start < SHUTDOWN_TIMEOUT_S + 0.35, (
        stream.ended_at - start
    )
    assert stream.error is None, stream.error  # ended in-band, not cut
    assert stream.done and 20 <= stream.chunks < MAX_TOKENS, stream.chunks
    (event,) = stream.events
    assert event["type"] == "service_unavailable", event
    assert "shutting down" in str(event["message"]), event
    assert "ended 1 request(s) still running" in err, err
    assert "timeout graceful shutdown exceeded" not in err, err  # uvicorn cut nothing
    assert "Exception in ASGI application" not in err, err  # one line, not a traceback
    assert "KV drain complete" in err, err
    (line,) = request_log.read_text().splitlines()  # the core ended (aborted) the request
    assert json.loads(line)["prompt_tokens"] == 3
