"""AsyncEngine on a real LLMEngine (tiny random-weight llama): results equal the engine's own,
concurrency, abort on early close, request errors, engine failure and shutdown never hang."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.async_engine import AsyncEngine, EngineDeadError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from tests.engine.hf_models import make_tiny_model

pytestmark = pytest.mark.timeout(60)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [
    [1, 17, 40, 99, 230, 7],
    [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    [1, 300],
]


def _config(model_dir: str) -> EngineConfig:
    return EngineConfig(
        model=model_dir,
        device="cpu",
        cache=CacheConfig(num_gpu_blocks=64),
        scheduler=SchedulerConfig(max_model_len=128),
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("async_engine"), "llama", seed=3)


@pytest.fixture(scope="module")
def reference(model_dir: str) -> list[list[int]]:
    """Greedy token ids of PROMPTS, stepping a plain LLMEngine on this thread."""
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(_config(model_dir))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    finals: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.req_id] = list(out.token_ids)
    return [finals[f"r{i}"] for i in range(len(PROMPTS))]


@pytest.fixture()
def engine(model_dir: str) -> Iterator[AsyncEngine]:
    async_engine = AsyncEngine.from_config(_config(model_dir))
    yield async_engine
    async_engine.shutdown()


async def _collect(engine: AsyncEngine, prompt: list[int], req_id: str) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, GREEDY, req_id)]


async def _wait_idle(engine: AsyncEngine, timeout_s: float = 10.0) -> dict[str, float | int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0:
            return stats
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine still busy: {engine.stats()}")


def test_generate_streams_deltas_that_add_up_to_the_engine_result(
    engine: AsyncEngine, reference: list[list[int]]
) -> None:
    outputs = asyncio.run(_collect(engine, PROMPTS[0], "a"))
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    final = outputs[-1]
    assert final.finish_reason == "length"
    assert list(final.token_ids) == reference[0]
    assert [t for o in outputs for t in o.new_token_ids] == reference[0]
    assert "".join(o.new_text for o in outputs) == final.text


def test_concurrent_requests_each_match_their_solo_result(
    engine: AsyncEngine, reference: list[list[int]]
) -> None:
    async def run_all() -> list[list[RequestOutput]]:
        return await asyncio.gather(
            *(_collect(engine, p, f"c{i}") for i, p in enumerate(PROMPTS * 2))
        )

    results = asyncio.run(run_all())
    assert [list(r[-1].token_ids) for r in results] == reference * 2
    stats = engine.stats()
    assert stats["generation_tokens_total"] == sum(len(r) for r in reference) * 2


def test_closing_the_stream_early_aborts_the_request(engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    async def run() -> dict[str, float | int]:
        stream = engine.generate(PROMPTS[1], params, "early")
        first = await anext(stream)
        assert not first.finished
        await stream.aclose()
        return await _wait_idle(engine)

    stats = asyncio.run(run())
    # Aborted long before its 100 tokens: the engine stopped generating for it.
    assert stats["generation_tokens_total"] < 50


def test_cancelled_consumer_aborts_the_request(engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    async def run() -> dict[str, float | int]:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate(PROMPTS[0], params, "cancel-me"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await _wait_idle(engine)

    assert asyncio.run(run())["generation_tokens_total"] < 50


def test_rejected_request_raises_value_error_and_others_continue(
    engine: AsyncEngine, reference: list[list[int]]
) -> None:
    async def run() -> tuple[BaseException | list[RequestOutput], ...]:
        return await asyncio.gather(
            _collect(engine, [], "empty"),
            _collect(engine, [1] * 200, "too-long"),
            _collect(engine, PROMPTS[2], "fine"),
            return_exceptions=True,
        )

    empty, too_long, fine = asyncio.run(run())
    assert isinstance(empty, ValueError)
    assert isinstance(too_long, ValueError)
    assert isinstance(fine, list) and list(fine[-1].token_ids) == reference[2]
    assert engine.is_running


def test_duplicate_request_id_is_rejected(engine: AsyncEngine) -> None:
    async def run() -> None:
        first = engine.generate(PROMPTS[0], GREEDY, "dup")
        await anext(first)
        with pytest.raises(ValueError, match="duplicate"):
            await anext(engine.generate(PROMPTS[0], GREEDY, "dup"))
        await first.aclose()

    asyncio.run(run())


def test_step_failure_fails_waiting_requests_and_later_ones(engine: AsyncEngine) -> None:
    real_step = engine.engine.step
    calls = {"n": 0}

    def failing_step() -> list[RequestOutput]:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected step failure")
        return real_step()

    engine.engine.step = failing_step  # type: ignore[method-assign]

    async def run() -> tuple[BaseException | list[RequestOutput], ...]:
        return await asyncio.wait_for(
            asyncio.gather(
                _collect(engine, PROMPTS[0], "x"),
                _collect(engine, PROMPTS[1], "y"),
                return_exceptions=True,
            ),
            timeout=20,
        )

    results = asyncio.run(run())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "injected step failure" in str(results[0])
    assert not engine.is_running
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(engine, PROMPTS[2], "after"))


def test_shutdown_releases_waiting_requests(engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    async def run() -> None:
        stream = engine.generate(PROMPTS[0], params, "s")
        await anext(stream)
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    asyncio.run(asyncio.wait_for(run(), timeout=20))
    assert not engine.is_running


def test_shutdown_closes_the_engine_on_its_thread(engine: AsyncEngine) -> None:
    closed_on: list[str] = []
    real_close = engine.engine.close

    def close() -> None:
        closed_on.append(threading.current_thread().name)
        real_close()

    engine.engine.close = close  # type: ignore[method-assign]
    engine.shutdown()
    engine.shutdown()  # idempotent: the engine is closed once
    assert closed_on == ["kvtier-engine"]


def test_idle_stats_carry_fresh_kv_details(engine: AsyncEngine) -> None:
    prompt = [1, *range(300, 320)]  # one full block, a prefix hit the second time

    async def run() -> dict[str, object]:
        for i in range(2):
            await _collect(engine, prompt, f"kv{i}")
        return await _wait_idle(engine)

    stats = asyncio.run(run())
    # Without offload, kv_stats() still reports the GPU hits; idle snapshots are never stale.
    assert stats["kv"]["gpu_hit_tokens"] == stats["prefix_cache_hit_tokens_total"] == 16  # type: ignore[index]
