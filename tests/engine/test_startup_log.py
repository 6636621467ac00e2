"""``engine.startup_log``: the engine's start-up block names the model, the KV budget and every
tier (capacity in binary units, path or URL without secrets, write policy)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine.startup_log import describe_tier, redact_url
from tests.engine.hf_models import make_tiny_model
from tiers.config import parse_tier_entry
from tiers.sizes import config_size


def test_sizes_and_urls_for_humans() -> None:
    assert [config_size(n) for n in (1000, 1024, 8 << 30, (8 << 30) + 1, 5982974 * 1024)] == [
        "1000B",
        "1KiB",
        "8GiB",
        "~8.0GiB",
        "~5.7GiB",
    ]
    assert redact_url("redis://:hunter2@cache:6379/0") == "redis://:***@cache:6379/0"
    assert redact_url("redis://app:hunter2@cache:6379/0?db=1&password=x") == (
        "redis://app:***@cache:6379/0?db=1&password=***"
    )
    assert redact_url("http://minio:9000") == "http://minio:9000"


def test_each_tier_kind_says_where_and_how_big_without_secrets() -> None:
    rows = {
        "host": ({"capacity": "4GiB"}, "host  4GiB of host memory"),
        "lmdb": ({"path": "/var/kv", "capacity": "100GiB"}, "lmdb  max 100GiB at /var/kv"),
        "redis": (
            {"url": "redis://:pw@r:6379/0", "ttl_s": 60},
            "redis bounded by the server's maxmemory at redis://:***@r:6379/0, ttl 60s",
        ),
        "s3": (
            {
                "bucket": "kv",
                "endpoint_url": "http://minio:9000",
                "access_key_id": "A",
                "secret_access_key": "S",
            },
            "s3    unbounded at s3://kv/kv/ via http://minio:9000",
        ),
        "remote": ({"url": "tcp://cs:7000", "token": "T0K"}, "remote at tcp://cs:7000, token set"),
    }
    for kind, (fields, expected) in rows.items():
        text = describe_tier(parse_tier_entry({"kind": kind, **fields}))
        assert text == expected
        assert "pw" not in text and "T0K" not in text and "S" not in text.split("s3://")[0][1:]


def test_engine_logs_one_block_with_model_kv_budget_and_tiers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from engine.llm import LLM

    model_dir = make_tiny_model(tmp_path, "llama", seed=6)
    offload = {
        "calibrate": False,
        "tiers": [
            {"kind": "host", "capacity": "2MiB"},
            {
                "kind": "lmdb",
                "path": str(tmp_path / "lmdb"),
                "capacity": "64MiB",
                "write_policy": "write_back",
            },
        ],
    }
    caplog.set_level(logging.INFO, logger="engine.llm_engine")
    llm = LLM(model_dir, device="cpu", num_gpu_blocks=24, kv_offload_config=offload)
    llm.close()
    (block,) = [r.getMessage() for r in caplog.records if "kvtier engine ready" in r.getMessage()]
    kv_bytes = 24 * llm.engine.runner.kv_cache.bytes_per_block
    assert block.splitlines() == [
        "kvtier engine ready",
        f"  model       {model_dir} (LlamaForCausalLM, float32, 2 layers, cpu)",
        f"  KV cache    24 blocks x 16 tokens = 384 tokens ({config_size(kv_bytes)}), "
        "max_model_len 384, prefix caching on",
        "  KV offload  2 tier(s), decision policy cost",
        "    tier 0    host  2MiB of host memory",
        f"    tier 1    lmdb  max 64MiB at {tmp_path / 'lmdb'}, write_back",
    ]
