"""``kvtier serve``'s process split on a GPU: the API process (FastAPI, tokenization) talks to an
engine core that runs the model on CUDA in its own process. Concurrent streaming clients get
the tokens the offline ``LLM`` gives; ``/health`` answers while a long prefill keeps the core
busy (bf16, FlashInfer, CUDA graphs: the path ``kvtier serve`` takes on a GPU). Skipped
without CUDA (the CPU variants live in test_server.py and test_core_proc.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.client import CoreProcConfig, EngineCoreClient
from engine.sampling_params import SamplingParams
from tests.engine.hf_models import TOKENIZER_VOCAB_SIZE, make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

MODEL = "gpu-llama"
CORE = CoreProcConfig(num_threads=2)


@contextmanager
def _serve(config: EngineConfig) -> Iterator[tuple[str, EngineCoreClient]]:
    from tests.engine.test_server import run_server

    engine = EngineCoreClient.start(config, CORE)
    try:
        with run_server(engine, MODEL) as base_url:
            yield base_url, engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(
        tmp_path_factory.mktemp("gpu_server"), "llama", seed=4,
        hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
        max_position_embeddings=8192,  # head_dim 128: the FlashInfer modules the suite warms
    )  # fmt: skip


def test_concurrent_streaming_clients_get_the_offline_tokens(model_dir: str) -> None:
    """fp32 on CUDA (torch attention: batch-invariant enough for exact greedy tokens)."""
    from engine.llm import LLM

    kw = dict(dtype="float32", device="cuda", attention_backend="torch")
    config = EngineConfig(
        model=model_dir,
        cache=CacheConfig(num_gpu_blocks=128),
        scheduler=SchedulerConfig(max_model_len=512),
        **kw,
    )  # type: ignore[arg-type]
    prompts = [
        "The cache keeps every block",
        "Redis holds the blocks",
        "a b c d e f g",
        "S3 is slow but large",
        "one more prompt for the batch",
    ]
    with LLM(model_dir, num_gpu_blocks=128, max_model_len=512, **kw) as llm:  # type: ignore[arg-type]
        refs = [
            o.text
            for o in llm.generate(
                prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            )
        ]
    with _serve(config) as (base_url, _engine):
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)

        def stream(prompt: str) -> str:
            chunks = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(stream, prompts)) == refs


def test_health_answers_while_a_long_prefill_runs_on_the_gpu(model_dir: str) -> None:
    """A 3000-token prompt under a 16-token step budget keeps the core busy for ~190 steps;
    every /health poll meanwhile answers fast (the API process never waits on it)."""
    config = EngineConfig(
        model=model_dir,
        dtype="bfloat16",
        device="cuda",
        attention_backend="flashinfer",
        cache=CacheConfig(num_gpu_blocks=512),
        scheduler=SchedulerConfig(
            max_model_len=8192, max_num_batched_tokens=16, max_num_seqs=4
        ),  # few graphs to capture at start-up
    )
    with _serve(config) as (base_url, engine):
        before = engine.stats()["generation_tokens_total"]
        prompt = [1] + [3 + i % (TOKENIZER_VOCAB_SIZE - 3) for i in range(3000)]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
        request = threading.Thread(
            target=httpx.post,
            args=(f"{base_url}/v1/completions",),
            kwargs={"json": body, "timeout": 120},
        )
        latencies: list[float] = []
        busy_polls = 0
        with httpx.Client(base_url=base_url, timeout=5) as http:
            http.get("/health")
            request.start()
            deadline = time.monotonic() + 120
            while engine.stats()["generation_tokens_total"] == before:
                assert time.monotonic() < deadline
                start = time.monotonic()
                assert http.get("/health").status_code == 200
                latencies.append(time.monotonic() - start)
                busy_polls += engine.stats()["num_requests_running"] == 1
                time.sleep(0.02)
        request.join(120)
        assert busy_polls >= 10, (busy_polls, latencies)
        assert max(latencies) < 0.2, sorted(latencies)[-5:]
