"""``GET /health``: 200 with each KV tier's state while the engine serves, ``degraded`` while a
tier is down. The degraded case is a real ``redis-server`` killed under a running
``EngineCoreClient`` (the engine core in its own process, as ``kvtier serve`` runs it), then
started again: the state follows the tier's failures and its recovery, with requests and
while the engine is idle."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.client import CoreProcConfig, EngineCoreClient
from engine.server.health import health_body, is_verbose
from tests.engine.hf_models import make_tiny_model
from tests.engine.test_server import run_server

pytestmark = pytest.mark.timeout(180)


def _row(name: str, failures: int = 0, **counters: int) -> dict[str, object]:
    return {
        "name": name,
        "consecutive_failures": failures,
        "errors": failures,
        "skipped": 0,
        "hits": 0,
        "misses": 0,
        "write_queue_depth": 0,
        "bytes_read": 0,
        **counters,
    }


def test_body_lists_tiers_and_says_degraded_while_one_fails() -> None:
    assert health_body({}) == {"status": "ok", "tiers": []}  # no offload
    stats = {"kv": {"store": {"tiers": [_row("host"), _row("redis", failures=3)]}}}
    assert health_body(stats) == {
        "status": "degraded",
        "tiers": [{"name": "host", "state": "up"}, {"name": "redis", "state": "down"}],
    }
    verbose = health_body(stats, verbose=True, model={"name": "m"})
    assert verbose["tiers"][1]["consecutive_failures"] == 3 and verbose["model"] == {"name": "m"}
    assert "bytes_read" not in verbose["tiers"][1]  # the details named in TIER_DETAILS only
    assert [is_verbose(v) for v in (None, "", "1", "true", "0", "false")] == [
        False,
        True,
        True,
        True,
        False,
        False,
    ]


def _wait_for(
    check: Callable[[], bool], what: str, timeout_s: float, poke: Callable[[], None]
) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        poke()
        time.sleep(0.3)


def test_health_reports_redis_down_then_back_with_a_real_server(redis_server, tmp_path) -> None:
    if not redis_server.managed:
        pytest.skip("needs a redis-server this test may kill")
    redis_server.ensure_running()
    redis_server.flush()
    model_dir = make_tiny_model(tmp_path, "llama", seed=2)
    offload = {
        "calibrate": False,
        "health_probe_s": 0.5,
        "tiers": [
            {"kind": "host", "capacity": "4MiB"},
            {"kind": "redis", "url": redis_server.url, "socket_timeout_s": 1.0},
        ],
    }
    config = EngineConfig(
        model=model_dir,
        device="cpu",
        cache=CacheConfig(num_gpu_blocks=32),
        scheduler=SchedulerConfig(max_model_len=128),
        kv_offload=True,
        kv_offload_config=offload,
    )
    engine = EngineCoreClient.start(config, CoreProcConfig(num_threads=1))
    prompts = iter(range(1000))
    try:
        with run_server(engine, "tiny") as base:

            def complete() -> int:
                prompt = [3 + next(prompts) % 200] * 40  # a new prefix each time: lookups
                body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
                return httpx.post(f"{base}/v1/completions", json=body, timeout=30).status_code

            def health(verbose: bool = False) -> dict:
                r = httpx.get(f"{base}/health" + ("?verbose=1" if verbose else ""), timeout=5)
                assert r.status_code == 200, r.text  # the engine serves whatever the tiers do
                return r.json()

            def redis_state() -> str:
                return {t["name"]: t["state"] for t in health()["tiers"]}["redis"]

            assert complete() == 200
            assert health() == {
                "status": "ok",
                "tiers": [{"name": "host", "state": "up"}, {"name": "redis", "state": "up"}],
            }

            redis_server.kill()
            _wait_for(
                lambda: redis_state() == "down", "redis down in /health", 30, lambda: complete()
            )
            body = health(verbose=True)
            assert body["status"] == "degraded"
            host, redis = body["tiers"]
            assert (host["name"], host["state"]) == ("host", "up")
            assert redis["errors"] >= 1 and redis["consecutive_failures"] >= 1
            assert body["model"]["name"] == "tiny"
            assert complete() == 200  # degraded: served by recomputing, not refused

            redis_server.start()
            _wait_for(
                lambda: redis_state() == "up", "redis up again in /health", 60, lambda: complete()
            )
            assert health()["status"] == "ok"

            # An idle engine: no request touches the tiers, yet /health follows Redis (the
            # store pings idle tiers; the core resends its stats while idle).
            redis_server.kill()
            _wait_for(
                lambda: redis_state() == "down", "idle redis down in /health", 30, lambda: None
            )
            redis_server.start()
            _wait_for(
                lambda: redis_state() == "up", "idle redis up again in /health", 60, lambda: None
            )
    finally:
        engine.shutdown()
        redis_server.ensure_running()
