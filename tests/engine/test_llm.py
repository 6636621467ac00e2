"""End to end: LLM.generate against HF ``model.generate(do_sample=False)`` on tiny random
models, with prefix hits, chunked prefill and preemption; stops; streaming; errors."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.tokenizer import encode_chat
from tests.engine.hf_models import build_tiny_hf_model, make_tiny_model

VOCAB = 512
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Any]]:
    root = tmp_path_factory.mktemp("models")
    out = {}
    for arch in ("llama", "qwen2", "qwen3"):
        hf = build_tiny_hf_model(arch, seed=3)
        hf.generation_config.eos_token_id = None  # reference runs exactly max_new_tokens
        out[arch] = (make_tiny_model(root, arch, seed=3), hf)
    return out


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        gen = hf.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=0, pad_token_id=0)
    return gen[0, len(prompt) :].tolist()


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_hf_with_and_without_prefix_hits(arch: str, models: dict) -> None:
    model_dir, hf = models[arch]
    llm = LLM(model_dir, num_gpu_blocks=64, dtype="float32", device="cpu")
    rng = random.Random(11)
    prompts = [rand_prompt(rng, n) for n in (3, 16, 29, 70)]
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.prompt_token_ids == p
        assert o.token_ids == hf_greedy(hf, p, 12), f"prompt of {len(p)} tokens"
        assert o.finish_reason == "length" and o.num_cached_tokens == 0
    assert llm.engine.stats()["prefix_cache_hit_tokens_total"] == 0
    # Second batch: long shared prefixes (the 70-token prompt's first 64 tokens) + new tails.
    base = prompts[3]
    second = [base[:64] + rand_prompt(rng, k) for k in (1, 9, 30)] + [base[:40]]
    outs2 = llm.generate(second, GREEDY)
    for p, o in zip(second, outs2, strict=True):
        assert o.token_ids == hf_greedy(hf, p, 12)
    # 4 full blocks hit for the first three, 2 for the 40-token prompt.
    assert [o.num_cached_tokens for o in outs2] == [64, 64, 64, 32]
    assert llm.engine.stats()["prefix_cache_hit_tokens_total"] == 64 * 3 + 32
    llm.engine.pool.check_integrity()


def test_chunked_prefill_matches_hf(models: dict) -> None:
    model_dir, hf = models["llama"]
    llm = LLM(
        model_dir, num_gpu_blocks=64, max_num_batched_tokens=16, dtype="float32", device="cpu"
    )
    rng = random.Random(5)
    prompts = [rand_prompt(rng, n) for n in (50, 7, 33)]
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf_greedy(hf, p, 12)
    assert llm.engine.stats()["prompt_tokens_total"] == 90


def test_preemption_matches_hf(models: dict) -> None:
    model_dir, hf = models["qwen2"]
    # 4 requests reach 48-51 tokens (4 blocks each) but the pool has only 8 blocks.
    llm = LLM(model_dir, num_gpu_blocks=8, max_num_seqs=4, dtype="float32", device="cpu")
    rng = random.Random(9)
    prompts = [rand_prompt(rng, n) for n in (20, 24, 27, 30)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.engine.stats()["num_preemptions_total"] > 0
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf_greedy(hf, p, 20)
    assert llm.engine.stats()["gpu_blocks_free"] == 8
    llm.engine.pool.check_integrity()


@pytest.fixture(scope="module")
def llama_llm(models: dict) -> LLM:
    return LLM(models["llama"][0], num_gpu_blocks=64, dtype="float32", device="cpu")


def test_max_tokens_and_stop_token_ids(llama_llm: LLM) -> None:
    rng = random.Random(21)
    prompt = rand_prompt(rng, 10)
    (full,) = llama_llm.generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    )
    assert len(full.token_ids) == 16 and full.finish_reason == "length"
    tok = llama_llm.tokenizer
    assert full.text == tok.decode(full.token_ids, skip_special_tokens=True)
    stop_tok = full.token_ids[6]
    first = full.token_ids.index(stop_tok)
    (o,) = llama_llm.generate(
        [prompt],
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_tok,)),
    )
    assert o.token_ids == full.token_ids[: first + 1]
    assert (o.finish_reason, o.stop_reason) == ("stop", stop_tok)
    assert o.text == tok.decode(full.token_ids[:first], skip_special_tokens=True)
    (short,) = llama_llm.generate(
        [prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    )
    assert short.token_ids == full.token_ids[:5] and short.finish_reason == "length"


def _pick_stop_string(tok: Any, ids: list[int]) -> tuple[str, int] | None:
    """A 2-char ASCII string completed exactly by token k (first occurrence); returns (s, k)."""
    full = tok.decode(ids, skip_special_tokens=True)
    for k in range(3, len(ids)):
        text_k = tok.decode(ids[:k], skip_special_tokens=True)
        s = text_k[-2:]
        if (
            len(s) == 2
            and s.isascii()
            and s.strip() == s
            and s not in tok.decode(ids[: k - 1], skip_special_tokens=True)
            and full.find(s) == len(text_k) - 2
        ):
            return s, k
    return None


def test_stop_strings_end_generation_exactly(llama_llm: LLM) -> None:
    tok = llama_llm.tokenizer
    rng = random.Random(4)
    found = 0
    for _ in range(6):
        prompt = rand_prompt(rng, 8)
        (full,) = llama_llm.generate(
            [prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        )
        pick = _pick_stop_string(tok, full.token_ids)
        if pick is None:
            continue
        s, k = pick
        found += 1
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(s,))
        (o,) = llama_llm.generate([prompt], params)
        assert o.token_ids == full.token_ids[:k]
        assert o.text == full.text[: full.text.find(s)]
        assert (o.finish_reason, o.stop_reason) == ("stop", s)
    assert found >= 2


def test_streaming_deltas_and_metrics(llama_llm: LLM) -> None:
    engine = llama_llm.engine
    engine.add_request(
        "s1", "hello world", SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    )
    deltas, ids, finals = [], [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.new_text)
            ids.extend(out.new_token_ids)
            finals.append(out)
    last = finals[-1]
    assert last.finished and len(finals) == 9
    assert ids == last.token_ids and "".join(deltas) == last.text
    assert last.metrics is not None and last.metrics.first_token_time is not None
    assert last.metrics.first_token_time >= last.metrics.arrival_time
    assert finals[0].metrics.first_token_time == last.metrics.first_token_time


def test_abort_and_errors(llama_llm: LLM) -> None:
    engine = llama_llm.engine
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add_request("a1", [5, 6, 7], params)
    with pytest.raises(ValueError, match="duplicate request id 'a1'"):
        engine.add_request("a1", [5], params)
    engine.step()
    engine.abort_request("a1")
    engine.abort_request("never-added")  # ignored
    outs = engine.step()
    assert [(o.req_id, o.finished, o.finish_reason) for o in outs] == [("a1", True, "abort")]
    assert not engine.has_unfinished_requests()
    assert engine.stats()["gpu_blocks_free"] == 64
    with pytest.raises(ValueError, match="prompt is empty"):
        llama_llm.generate([[]], params)
    with pytest.raises(ValueError, match="shorter than max_model_len"):
        llama_llm.generate([[5] * 512], params)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llama_llm.generate([[5, VOCAB]], params)
    assert not engine.has_unfinished_requests()


def test_unknown_kwargs_raise_type_error() -> None:
    with pytest.raises(TypeError, match="bogus, nope"):
        LLM("unused", nope=1, bogus=2)


def test_chat_uses_the_template(models: dict, llama_llm: LLM) -> None:
    _, hf = models["llama"]
    conv = [{"role": "user", "content": "hello cache"}]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (o,) = llama_llm.chat(conv, params)
    ids = encode_chat(llama_llm.tokenizer, conv)
    assert o.prompt_token_ids == ids
    assert o.token_ids == hf_greedy(hf, ids, 6)
    both = llama_llm.chat([conv, [{"role": "user", "content": "bye"}]], params)
    assert both[0].token_ids == o.token_ids and len(both) == 2


def test_text_prompt_and_single_token_list(llama_llm: LLM, models: dict) -> None:
    _, hf = models["llama"]
    (o,) = llama_llm.generate("the cache", GREEDY)
    ids = llama_llm.tokenizer.encode("the cache")
    assert o.prompt_token_ids == ids and o.token_ids == hf_greedy(hf, ids, 12)
    (o2,) = llama_llm.generate(ids, GREEDY)
    assert o2.token_ids == o.token_ids


def test_engine_exports_are_lazy(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = "import sys, engine; engine.SamplingParams; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_preemption_with_kv_offload_matches_hf(models: dict, tmp_path: Path) -> None:
    """Preempted requests come back through the host tier (decision: load) and still match HF;
    the engine's stats() carries the flat kv_*_total counters."""
    model_dir, hf = models["qwen2"]
    config = {"decision": "load", "tiers": [{"kind": "host", "capacity": "4MiB"}]}
    log_path = tmp_path / "req.jsonl"
    with LLM(
        model_dir,
        num_gpu_blocks=8,
        max_num_seqs=4,
        dtype="float32",
        device="cpu",
        kv_offload=True,
        kv_offload_config=config,
        request_log=str(log_path),
    ) as llm:
        rng = random.Random(9)
        prompts = [rand_prompt(rng, n) for n in (20, 24, 27, 30)]
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params)
        for p, o in zip(prompts, outs, strict=True):
            assert o.token_ids == hf_greedy(hf, p, 20)
        stats = llm.engine.stats()
        assert stats["num_preemptions_total"] > 0
        assert stats["kv_loaded_tokens_total"] == llm.kv_stats()["loaded_tokens"]
        assert stats["gpu_blocks_free"] == 8
        llm.engine.pool.check_integrity()
    llm.close()  # idempotent
    lines = log_path.read_text().splitlines()
    assert len(lines) == 4 and all('"decision"' in line for line in lines)


def test_request_log_without_offload(models: dict, tmp_path: Path) -> None:
    log_path = tmp_path / "sub" / "req.jsonl"
    llm = LLM(
        models["llama"][0],
        num_gpu_blocks=64,
        dtype="float32",
        device="cpu",
        request_log=str(log_path),
    )
    p = rand_prompt(random.Random(4), 40)
    llm.generate([p, p], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    llm.generate([p], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    llm.close()
    import json

    rows = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [r["req_id"] for r in rows] == ["llm-0", "llm-1", "llm-2"]
    assert [len(r["block_hashes"]) for r in rows] == [2, 2, 2]
    assert rows[0]["hit_tiers"] == [] and rows[2]["hit_tiers"] == ["gpu", "gpu"]
    assert all(r["decision"] == "recompute" and r["prompt_tokens"] == 40 for r in rows)
    assert llm.kv_stats()["gpu_hit_tokens"] == llm.engine.stats()["prefix_cache_hit_tokens_total"]


def test_engine_without_detokenization_gives_token_ids_only(models: dict, llama_llm: LLM) -> None:
    """``detokenize=False`` (the engine-core process): the same token ids, no text, and stop
    strings left to the caller; stop token ids still end a request."""
    from engine.llm_engine import LLMEngine

    tok = llama_llm.tokenizer
    rng = random.Random(4)
    prompt = rand_prompt(rng, 8)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    (full,) = llama_llm.generate([prompt], params)
    pick = _pick_stop_string(tok, full.token_ids)
    assert pick is not None
    engine = LLMEngine(llama_llm.config, detokenize=False)
    stop_tok = full.token_ids[5]
    engine.add_request("s", prompt, dataclasses.replace(params, stop=(pick[0],)))
    engine.add_request("t", prompt, dataclasses.replace(params, stop_token_ids=(stop_tok,)))
    finals: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.text == "" and out.new_text == ""
            if out.finished:
                finals[out.req_id] = out
    assert finals["s"].token_ids == full.token_ids  # the stop string is not seen here
    assert finals["s"].finish_reason == "length"
    first = full.token_ids.index(stop_tok)
    assert finals["t"].token_ids == full.token_ids[: first + 1]
    assert (finals["t"].finish_reason, finals["t"].stop_reason) == ("stop", stop_tok)


def test_enforce_eager_maps_from_llm_kwargs_and_the_serve_flag(models: dict) -> None:
    import argparse

    from engine.server.cli import add_arguments, engine_config_from_args

    llm = LLM(
        models["llama"][0], num_gpu_blocks=8, dtype="float32", device="cpu", enforce_eager=True
    )
    assert llm.config.enforce_eager and llm.engine.runner.cuda_graphs is None
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert engine_config_from_args(parser.parse_args(["--enforce-eager"])).enforce_eager
    default = engine_config_from_args(parser.parse_args([]))
    assert not default.enforce_eager
    assert (default.attention_backend, default.graph_decode) == ("auto", "auto")
    assert default.cache.gpu_memory_utilization == 0.9
    assert (
        engine_config_from_args(
            parser.parse_args(["--gpu-memory-utilization", "0.5"])
        ).cache.gpu_memory_utilization
        == 0.5
    )
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        engine_config_from_args(parser.parse_args(["--gpu-memory-utilization", "1.5"]))
    picked = engine_config_from_args(
        parser.parse_args(["--attention-backend", "flashinfer", "--graph-decode", "flashinfer"])
    )
    assert (picked.attention_backend, picked.graph_decode) == ("flashinfer", "flashinfer")
    with pytest.raises(SystemExit):  # argparse refuses an unknown kernel
        parser.parse_args(["--graph-decode", "cuda"])
    with pytest.raises(ValueError, match="graph_decode"):
        LLM(models["llama"][0], num_gpu_blocks=8, device="cpu", graph_decode="cuda")


@pytest.mark.gpu
def test_enforce_eager_skips_cuda_graphs(models: dict) -> None:
    kw: dict[str, Any] = dict(num_gpu_blocks=8, dtype="bfloat16", device="cuda")
    assert LLM(models["llama"][0], **kw).engine.runner.cuda_graphs is not None
    assert LLM(models["llama"][0], enforce_eager=True, **kw).engine.runner.cuda_graphs is None


def test_engine_start_up_objects_leave_the_collector_until_close(models: dict) -> None:
    """After start-up the engine freezes what exists (a full collection then skips it); a
    closed engine unfreezes, so its reference cycles can be collected."""
    import gc

    model_dir, _ = models["llama"]
    gc.unfreeze()
    with LLM(model_dir, device="cpu", num_gpu_blocks=16) as llm:
        assert gc.get_freeze_count() > 1000  # torch, the model, the engine
        assert llm.generate([[1, 5, 9]], SamplingParams(max_tokens=2, temperature=0.0))
    assert gc.get_freeze_count() == 0
