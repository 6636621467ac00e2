"""End to end: ``LLM(kv_offload=True)`` on a tiny model with a GPU pool far smaller than the
working set. Outputs must equal the no-offload engine's token for token while blocks really
come back from the host, LMDB, Redis and S3 tiers; kv_stats() and the request log are checked
exactly in a hand-computed scenario."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from cachestore.codec import encoded_size
from cachestore.hashing import Namespace, hash_request_tokens
from engine import LLM, SamplingParams

VOCAB = 500
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SLOT = 8192 + 160  # one encoded block of the tiny model, with room for the codec header


def make_llm(model_dir: str, num_blocks: int, offload: dict | None = None, **kw: Any) -> LLM:
    if offload is None:
        return LLM(model_dir, num_gpu_blocks=num_blocks, dtype="float32", device="cpu", **kw)
    return LLM(
        model_dir,
        num_gpu_blocks=num_blocks,
        dtype="float32",
        device="cpu",
        kv_offload=True,
        kv_offload_config=offload,
        **kw,
    )


def run_conversations(llm: LLM, users: int = 6, turns: int = 4, seed: int = 5) -> list[list[int]]:
    """Multi-turn chats as token ids: each turn appends the reply and 18 new user tokens.
    Returns every reply, turn-major."""
    rng = random.Random(seed)
    histories = [[rng.randrange(3, VOCAB) for _ in range(40)] for _ in range(users)]
    replies: list[list[int]] = []
    for _ in range(turns):
        outs = llm.generate(histories, GREEDY)
        for h, o in zip(histories, outs, strict=True):
            replies.append(list(o.token_ids))
            h.extend(o.token_ids)
            h.extend(rng.randrange(3, VOCAB) for _ in range(18))
    return replies


@pytest.fixture(scope="module")
def reference(model_dir: str) -> list[list[int]]:
    return run_conversations(make_llm(model_dir, 24))


def host_lmdb(tmp_path: Path, host_slots: int = 12) -> dict:
    return {
        "decision": "load",
        "tiers": [
            {"kind": "host", "capacity": f"{host_slots * SLOT}B"},
            {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"},
        ],
    }


def test_host_and_lmdb_reloads_keep_outputs_and_survive_a_restart(
    model_dir: str, reference: list[list[int]], tmp_path: Path
) -> None:
    config = host_lmdb(tmp_path)
    with make_llm(model_dir, 24, config) as llm:
        assert run_conversations(llm) == reference
        kv = llm.kv_stats()
    assert kv["tiers"]["host"]["hit_blocks"] > 0 and kv["tiers"]["lmdb"]["hit_blocks"] > 0
    assert kv["loaded_tokens"] == 16 * kv["loaded_blocks"] > 0
    assert kv["failed_loads"] == 0 and kv["recomputed_tokens"] == 0
    assert kv["decisions"]["load_prefix"] > 0 and kv["saved_blocks"] > 0
    # A new engine, same model and LMDB path, empty host tier: it finds the old blocks.
    with make_llm(model_dir, 24, config) as again:
        assert run_conversations(again) == reference
        kv2 = again.kv_stats()
    assert kv2["tiers"]["lmdb"]["hit_blocks"] > 0
    assert kv2["failed_loads"] == 0
    # The first turn of every user is fully served from LMDB (40-token prompts: 2 blocks).
    assert kv2["tiers"]["lmdb"]["hit_blocks"] >= 6 * 2


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_redis_and_s3_tiers_serve_reloads(
    model_dir: str, reference: list[list[int]], kind: str, request: pytest.FixtureRequest
) -> None:
    tier = request.getfixturevalue(f"{kind}_config")
    config = {"decision": "load", "tiers": [tier]}
    with make_llm(model_dir, 24, config) as llm:
        assert run_conversations(llm, turns=3) == reference[: 6 * 3]
        kv = llm.kv_stats()
    assert kv["tiers"][kind]["hit_blocks"] > 0 and kv["failed_loads"] == 0
    with make_llm(model_dir, 24, config) as again:  # a restart finds them too
        assert run_conversations(again, turns=1) == reference[:6]
        assert again.kv_stats()["tiers"][kind]["hit_blocks"] == 6 * 2


def test_recompute_policy_loads_nothing_and_counts_recomputed(
    model_dir: str, reference: list[list[int]], tmp_path: Path
) -> None:
    config = {**host_lmdb(tmp_path, host_slots=64), "decision": "recompute"}
    with make_llm(model_dir, 24, config) as llm:
        assert run_conversations(llm, turns=2) == reference[:12]
        kv = llm.kv_stats()
    assert kv["loaded_tokens"] == 0 and kv["loaded_blocks"] == 0
    assert kv["recomputed_tokens"] > 0 and set(kv["decisions"]) == {"recompute"}


def test_kv_stats_are_exact_for_one_evicted_and_reloaded_prompt(
    model_dir: str, tmp_path: Path
) -> None:
    """P: 85 tokens (5 full blocks), pool of 10 blocks. P runs and is freed tail first; Q
    (120 tokens, 8 blocks) evicts P's blocks 4, 3, 2 (the queue holds 6..9 then P's 5..0).
    P again: GPU hit = blocks 0, 1 (32 tokens), the host tier supplies 2..4 (48 tokens)."""
    rng = random.Random(2)
    p = [rng.randrange(3, VOCAB) for _ in range(85)]
    q = [rng.randrange(3, VOCAB) for _ in range(120)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    log_path = tmp_path / "requests.jsonl"
    config = {"decision": "load", "tiers": [{"kind": "host", "capacity": f"{64 * SLOT}B"}]}
    with make_llm(model_dir, 10, config, request_log=str(log_path)) as llm:
        first = llm.generate([p], one)[0].token_ids
        llm.generate([q], one)
        again = llm.generate([p], one)[0].token_ids
        kv = llm.kv_stats()
    assert again == first
    assert kv["gpu_hit_tokens"] == 32 and kv["loaded_tokens"] == 80 - 32
    assert kv["recomputed_tokens"] == 0
    assert kv["loaded_blocks"] == 3 and kv["loaded_bytes"] == 3 * 8192
    assert kv["num_loads"] == 1 and kv["failed_loads"] == 0
    assert kv["decisions"] == {"load_prefix": 1}
    assert kv["tiers"]["host"]["hit_blocks"] == 3
    # Saved: P's 5 full blocks, then Q's 7; P's second run finds all 5 already stored.
    assert kv["saved_blocks"] == 12 and kv["saved_bytes"] == 12 * 8192
    assert kv["save_skipped_blocks"] == 5
    lines = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [e["req_id"] for e in lines] == ["llm-0", "llm-1", "llm-2"]
    ns = Namespace(model_fingerprint=llm.engine.runner.model_fingerprint)
    hashes = [h.hex() for h in hash_request_tokens(ns, p)]
    assert lines[2]["block_hashes"] == hashes and len(hashes) == 5
    assert lines[2]["prompt_tokens"] == 85
    assert lines[2]["hit_tiers"] == ["gpu", "gpu", "host", "host", "host"]
    assert lines[2]["decision"] == "load_prefix" and lines[0]["decision"] == "recompute"
    assert lines[0]["hit_tiers"] == [] and lines[0]["ttft_s"] > 0
    assert set(lines[0]) == {
        "ts",
        "req_id",
        "prompt_tokens",
        "block_hashes",
        "hit_tiers",
        "decision",
        "ttft_s",
        "ttft_breakdown_s",
        "num_prefill_steps",
        "kv_load_s",
        "prefill_step_tokens",
        "prefill_step_parts_s",
        "kv_plan",
    }
    assert lines[0]["kv_load_s"] == {"read": 0.0, "copy": 0.0}  # nothing loaded
    assert lines[0]["prefill_step_tokens"] >= 85  # its steps carried its own prompt at least
    # The planned split of the reload: 2 blocks from the GPU, 3 loaded, the last 5 recomputed.
    assert lines[2]["kv_plan"] == {
        "gpu_tokens": 32,
        "head_tokens": 0,
        "load_tokens": 48,
        "recompute_tokens": 5,
        "predicted_s": 0.0,
        "backlog_s": 0.0,
        "options": {},  # the ``load`` policy weighs nothing
    }
    assert lines[2]["kv_load_s"]["copy"] > 0 and lines[2]["kv_load_s"]["read"] == 0.0


def test_default_config_uses_host_and_lmdb_in_the_cache_dir(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    with make_llm(model_dir, 24, None, kv_offload=True) as llm:
        store = llm.engine.offload.store  # type: ignore[union-attr]
        assert [t.name for t in store.tiers] == ["host", "lmdb"]
        prefix = llm.engine.namespace.key_prefix()
        assert (tmp_path / "lmdb" / prefix).is_dir()
        host = store.tiers[0]
        meta = llm.engine.offload.worker.meta  # type: ignore[union-attr]
        assert meta.payload_bytes == llm.engine.runner.kv_cache.bytes_per_block == 8192
        assert (
            host.slot_bytes == -(-encoded_size(meta, keyed=True) // 16) * 16 > 8192
        )  # 16-byte aligned slots
        assert 1 << 20 <= host.num_slots * host.slot_bytes <= 8 << 30


@pytest.mark.gpu
def test_cuda_side_stream_saves_and_batched_loads_keep_outputs(model_dir: str) -> None:
    """On CUDA: saves gathered on the side stream into pinned memory, loads scattered in one
    batched copy; outputs equal the no-offload engine's on the same device."""
    kw: dict[str, Any] = dict(dtype="float32", device="cuda", attention_backend="torch")
    ref = run_conversations(LLM(model_dir, num_gpu_blocks=24, **kw))
    config = {"decision": "load", "tiers": [{"kind": "host", "capacity": f"{256 * SLOT}B"}]}
    with LLM(model_dir, num_gpu_blocks=24, kv_offload=True, kv_offload_config=config, **kw) as llm:
        assert llm.engine.offload.store.tiers[0].pinned_memory  # type: ignore[union-attr]
        assert run_conversations(llm) == ref
        kv = llm.kv_stats()
    assert kv["tiers"]["host"]["hit_blocks"] > 0 and kv["failed_loads"] == 0
    assert kv["loaded_tokens"] > 0 and kv["saved_blocks"] > 0
