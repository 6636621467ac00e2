"""The offload connector under tensor parallelism, on CPU (gloo, 2 ranks): outputs at TP=2 with
offload equal TP=1 without, and KV blocks stored as head slices (``kv_head_group: 1``) are
loaded, not recomputed, by an engine at the other degree, through LMDB."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from tests.engine.hf_models import make_tiny_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tp-offload"), "llama", seed=7)


def _llm(model_dir: str, tp: int, blocks: int, offload: dict | None = None) -> LLM:
    kw: dict[str, Any] = {}
    if offload is not None:
        kw = {"kv_offload": True, "kv_offload_config": offload}
    return LLM(model_dir, num_gpu_blocks=blocks, dtype="float32", device="cpu",
               tensor_parallel_size=tp, **kw)


def _offload(tmp_path: Path, group: int = 0, host_blocks: int = 8) -> dict:
    return {
        "decision": "load", "calibrate": False, "kv_head_group": group,
        "tiers": [{"kind": "host", "capacity": f"{host_blocks * 20000}B"},
                  {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"}],
    }


def _prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


def _run(llm: LLM, rounds: list[list[list[int]]]) -> list[list[int]]:
    return [list(o.token_ids) for prompts in rounds for o in llm.generate(prompts, GREEDY)]


def test_tp2_with_offload_equals_tp1_and_reloads(model_dir: str, tmp_path: Path) -> None:
    # Two batches that cannot both stay in a 12-block pool, then the first again: its blocks
    # come back from the tiers (each rank its own slice).
    a, b = _prompts(1, 3, 40), _prompts(2, 3, 40)
    rounds = [a, b, a]
    with _llm(model_dir, 1, 12) as ref:
        want = _run(ref, rounds)
    with _llm(model_dir, 2, 12, _offload(tmp_path)) as llm:
        got = _run(llm, rounds)
        kv = llm.kv_stats()
    assert got == want
    assert kv["loaded_tokens"] > 0 and kv["failed_loads"] == 0, kv


@pytest.mark.parametrize("first,second", [(2, 1), (1, 2)])
def test_head_slices_stored_at_one_degree_load_at_another(
    model_dir: str, tmp_path: Path, first: int, second: int
) -> None:
    prompt = _prompts(3, 1, 70)  # 4 full blocks
    config = _offload(tmp_path, group=1)
    with _llm(model_dir, first, 16, config) as llm:
        want = _run(llm, [prompt])
        assert llm.kv_stats()["loaded_tokens"] == 0
    # A fresh engine (empty host tier): the prefix comes from LMDB, every head slice of it.
    for tp in (second, first):
        with _llm(model_dir, tp, 16, config) as llm:
            got = _run(llm, [prompt])
            kv = llm.kv_stats()
        assert got == want, f"TP={tp}"
        assert kv["loaded_tokens"] == 64 and kv["recomputed_tokens"] == 0, (tp, kv)
        assert kv["tiers"]["lmdb"]["hit_blocks"] > 0
