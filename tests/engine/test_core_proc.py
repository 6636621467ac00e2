"""The engine core in its own process (``EngineCoreClient``): wire format, outputs equal to
``LLM.generate`` for every sampling mode (detokenization and stop strings now happen in the API
process), aborts reaching the core, startup errors, and the HTTP server on a deliberately slow
model: ``/health`` answers during a long prefill, a client disconnect aborts in the core, and
killing the core fails pending requests and turns ``/health`` to 503."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import httpx
import msgpack
import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.base import EngineDeadError, EngineStalledError
from engine.core.client import CoreProcConfig, EngineCoreClient, EngineStartupError
from engine.core.messages import (
    AbortRequests,
    AddRequest,
    CoreOutput,
    Ready,
    RequestRejected,
    Shutdown,
    StatsRequest,
    StepOutputs,
    decode_event,
    decode_request,
    encode_event,
    encode_request,
)
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from tests.engine.hf_models import make_tiny_model

pytestmark = pytest.mark.timeout(90)
ONE_THREAD = CoreProcConfig(num_threads=1)  # 2-core CI machine: the core must not take both
PROMPTS = [
    [1, 17, 40, 99, 230, 7],
    [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    [1, 300],
]


def _config(model_dir: str, **scheduler: object) -> EngineConfig:
    return EngineConfig(
        model=model_dir,
        device="cpu",
        cache=CacheConfig(num_gpu_blocks=64),
        scheduler=SchedulerConfig(max_model_len=128, **scheduler),  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("core_proc"), "llama", seed=3)


@pytest.fixture(scope="module")
def client(model_dir: str) -> Iterator[EngineCoreClient]:
    engine = EngineCoreClient.start(_config(model_dir), ONE_THREAD)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def llm(model_dir: str) -> object:
    from engine.llm import LLM

    return LLM(model_dir, device="cpu", num_gpu_blocks=64, max_model_len=128)


async def _collect(
    engine: EngineCoreClient, prompt: list[int], params: SamplingParams, req_id: str
) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, req_id)]


def _wait_idle(engine: EngineCoreClient, timeout_s: float = 10.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0:
            return stats
        time.sleep(0.01)
    raise AssertionError(f"engine still busy: {engine.stats()}")


# --- wire format --------------------------------------------------------------------------------


def test_messages_round_trip_through_msgpack() -> None:
    params = SamplingParams(max_tokens=5, temperature=0.5, top_k=3, seed=9, stop=["ab"],
                            stop_token_ids=[4], min_tokens=1, extra={"k": [1, 2]})  # fmt: skip
    requests = [AddRequest("r", [1, 2], params, 12.5), AbortRequests(["a", "b"]),
                StatsRequest(), Shutdown()]  # fmt: skip
    for msg in requests:
        data = encode_request(msg)
        assert isinstance(msgpack.unpackb(data), list)  # plain msgpack, no pickle inside
        assert decode_request(data) == msg
    out = CoreOutput("r", [7], True, "stop", 4, 16, 1.0, 2.0, 2.5)
    stats = {"n_total": 3, "tiers": [{"name": "host", "hits": 1}], "odd": object()}
    events = [Ready("m", 128, {"a": 1}, 42), RequestRejected("r", "bad"),
              StepOutputs([out, replace(out, req_id="s", finished=False)], stats)]  # fmt: skip
    decoded = [decode_event(encode_event(e)) for e in events]
    assert decoded[:2] == events[:2]
    assert decoded[2] == StepOutputs(events[2].outputs, {**stats, "odd": None})


def test_malformed_messages_raise_value_error() -> None:
    for data in (b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([99]), msgpack.packb([1, "r"])):
        with pytest.raises(ValueError):
            decode_request(data)
    with pytest.raises(ValueError, match="malformed AddRequest"):
        decode_request(msgpack.packb([1, "r", [1], {"max_tokens": 0}, 1.0]))
    with pytest.raises(ValueError):
        decode_event(msgpack.packb([13, [["r"]], {}]))


# --- the client against a real core process ---------------------------------------------------


def _sampling_modes(llm: object) -> list[SamplingParams]:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = llm.generate([PROMPTS[0]], greedy)[0]  # type: ignore[attr-defined]
    text = ref.text
    stop = next(text[i : i + 2] for i in range(len(text) // 3, len(text)) if text[i].strip())
    return [
        greedy,
        replace(greedy, stop=(stop,)),  # a stop string in the middle of the greedy text
        replace(greedy, stop=(stop,), min_tokens=10),  # ignored until 10 tokens exist
        replace(greedy, stop_token_ids=(ref.token_ids[4],)),
        SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=7),  # EOS may end it
        SamplingParams(max_tokens=12, temperature=1.0, top_p=0.8, seed=3, ignore_eos=True),
    ]


def test_outputs_equal_llm_generate_for_every_sampling_mode(
    client: EngineCoreClient, llm: object
) -> None:
    modes = _sampling_modes(llm)
    cases = [(p, sp) for p in PROMPTS for sp in modes]

    async def run_all() -> list[list[RequestOutput]]:
        return await asyncio.gather(
            *(_collect(client, p, sp, f"m{i}") for i, (p, sp) in enumerate(cases))
        )

    results = asyncio.run(run_all())
    # One batch: the engine's results do not depend on batching (greedy, and seeded sampling).
    refs = llm.generate([p for p, _ in cases], [sp for _, sp in cases])  # type: ignore[attr-defined]
    for (prompt, _), outputs, ref in zip(cases, results, refs, strict=True):
        final = outputs[-1]
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        got = (final.token_ids, final.text, final.finish_reason, final.stop_reason)
        assert got == (ref.token_ids, ref.text, ref.finish_reason, ref.stop_reason)
        assert final.prompt_token_ids == prompt
        assert [t for o in outputs for t in o.new_token_ids] == ref.token_ids
        assert "".join(o.new_text for o in outputs) == ref.text
    assert {r.finish_reason for r in refs} >= {"length", "stop"}  # both paths exercised
    assert any(isinstance(r.stop_reason, str) for r in refs)
    assert any(isinstance(r.stop_reason, int) for r in refs)
    _wait_idle(client)


def test_stop_string_aborts_the_request_in_the_core(client: EngineCoreClient, llm: object) -> None:
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    ref = llm.generate([PROMPTS[1]], replace(params, max_tokens=12))[0]  # type: ignore[attr-defined]
    stop = next(ref.text[i : i + 2] for i in range(len(ref.text) // 2, 0, -1)
                if ref.text[i].strip())  # fmt: skip
    before = _wait_idle(client)["generation_tokens_total"]
    outputs = asyncio.run(_collect(client, PROMPTS[1], replace(params, stop=(stop,)), "stop"))
    final = outputs[-1]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert len(final.token_ids) <= len(ref.token_ids)
    after = _wait_idle(client)["generation_tokens_total"]
    # The core ran ahead of the abort by a few steps at most, never to max_tokens.
    assert len(final.token_ids) <= after - before < len(final.token_ids) + 20  # type: ignore[operator]


def test_prefix_hit_and_metrics_cross_the_process_boundary(client: EngineCoreClient) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompt = [1, *range(300, 320)]  # 21 tokens: one full 16-token block
    first = asyncio.run(_collect(client, prompt, params, "px1"))[-1]
    second = asyncio.run(_collect(client, prompt, params, "px2"))[-1]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 16)
    m = second.metrics
    assert m is not None and m.first_token_time is not None and m.last_token_time is not None
    assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time  # type: ignore[operator]
    # An explicit stats request gets a fresh snapshot pushed back (the core is idle by now).
    snapshot = client.stats()
    client.request_stats()
    deadline = time.monotonic() + 10
    while client.stats() is snapshot:
        assert time.monotonic() < deadline, "no stats reply"
        time.sleep(0.005)
    assert client.stats()["prefix_cache_hit_tokens_total"] >= 16


def test_closing_the_stream_early_aborts_in_the_core(client: EngineCoreClient) -> None:
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    before = _wait_idle(client)["generation_tokens_total"]

    async def run() -> None:
        stream = client.generate(PROMPTS[1], params, "early")
        assert not (await anext(stream)).finished
        await stream.aclose()

    asyncio.run(run())
    assert _wait_idle(client)["generation_tokens_total"] - before < 50  # type: ignore[operator]


def test_rejected_and_duplicate_requests(client: EngineCoreClient, llm: object) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[BaseException | list[RequestOutput], ...]:
        first = client.generate(PROMPTS[0], greedy, "dup")
        await anext(first)
        with pytest.raises(ValueError, match="duplicate"):
            await anext(client.generate(PROMPTS[0], greedy, "dup"))
        await first.aclose()
        return await asyncio.gather(
            _collect(client, [], greedy, "empty"),
            _collect(client, [1] * 200, greedy, "too-long"),
            _collect(client, [1, 10**6], greedy, "vocab"),
            _collect(client, PROMPTS[2], greedy, "fine"),
            return_exceptions=True,
        )

    empty, too_long, vocab, fine = asyncio.run(run())
    assert isinstance(empty, ValueError) and "empty" in str(empty)
    assert isinstance(too_long, ValueError) and "max_model_len" in str(too_long)
    assert isinstance(vocab, ValueError) and "vocabulary" in str(vocab)
    ref = llm.generate([PROMPTS[2]], greedy)[0]  # type: ignore[attr-defined]
    assert isinstance(fine, list) and fine[-1].token_ids == ref.token_ids
    assert client.is_running


def test_the_core_outlives_sigterm_and_sigint_and_stops_on_shutdown(model_dir: str) -> None:
    """A supervisor signals the whole process group: the core ignores it and keeps serving
    until ``shutdown``, which then reports a clean stop (exit code 0, nothing to drain)."""
    engine = EngineCoreClient.start(_config(model_dir), ONE_THREAD)
    try:
        os.kill(engine.core_pid, signal.SIGTERM)
        os.kill(engine.core_pid, signal.SIGINT)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        outs = asyncio.run(_collect(engine, [1, 2, 3], params, "sig1"))
        assert outs[-1].finished and engine.is_running
    finally:
        problem = engine.shutdown()
    assert problem is None
    assert engine.shutdown() is None  # idempotent: the same answer


def test_shutdown_reports_a_core_that_died_first(model_dir: str) -> None:
    engine = EngineCoreClient.start(_config(model_dir), ONE_THREAD)
    os.kill(engine.core_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while engine.dead_error is None:  # the output thread saw it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    problem = engine.shutdown()
    assert problem == (
        "the engine core died before shutdown (engine core process died (exit code -9))"
    )


def test_a_malformed_message_from_the_core_fails_its_requests_instead_of_losing_them(
    model_dir: str, tmp_path
) -> None:
    """A message the API cannot decode (a version mismatch between the two processes, a
    corrupted frame) may have carried any request's outputs: the engine is declared dead and
    the request in flight fails at once rather than waiting for good."""
    import zmq

    engine = EngineCoreClient.start(_config(model_dir), replace(ONE_THREAD, ipc_dir=str(tmp_path)))
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.PUSH)
    rogue.connect(f"ipc://{tmp_path}/events")
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)

    async def run() -> BaseException | None:
        started = time.monotonic()
        try:
            async for out in engine.generate([1, 5, 6, 7], params, "victim"):
                if len(out.token_ids) == 1:  # in flight: now the bad frame
                    rogue.send(msgpack.packb([13, [["victim", "not a list"]], {}]))
        except EngineDeadError as exc:
            assert time.monotonic() - started < 30
            return exc
        return None

    try:
        error = asyncio.run(run())
        assert isinstance(error, EngineDeadError), "the request finished as if nothing happened"
        assert "malformed" in str(error)
        assert engine.dead_error is error
    finally:
        rogue.close(linger=0)
        ctx.term()
        engine.shutdown()


def test_a_malformed_request_message_ends_the_core_and_fails_what_it_ran(model_dir: str) -> None:
    """The other way: a request message the core cannot decode may have been any request
    (an AddRequest lost is a request that never answers), so the core reports it and exits,
    and the request in flight fails at once."""
    engine = EngineCoreClient.start(_config(model_dir), ONE_THREAD)
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)

    async def run() -> BaseException | None:
        try:
            async for out in engine.generate([1, 5, 6, 7], params, "victim"):
                if len(out.token_ids) == 1:
                    engine._send(msgpack.packb([1, "not an AddRequest"]))
        except EngineDeadError as exc:
            return exc
        return None

    try:
        error = asyncio.run(run())
        assert isinstance(error, EngineDeadError), "the request finished as if nothing happened"
        assert "malformed request message" in str(error)
        assert engine.shutdown() is not None  # the core failed: shutdown says so
    finally:
        engine.shutdown()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_stopped_core_is_declared_stalled_and_shutdown_kills_it_at_once(model_dir: str) -> None:
    """SIGSTOP: the core process lives on but says nothing, as one stuck in a CUDA call. Once
    ``stall_timeout_s`` passed, the waiting request fails naming the stall, the client stops
    running, and ``shutdown`` kills the core at once instead of waiting for a drain (30 s here)."""
    engine = EngineCoreClient.start(_config(model_dir), replace(ONE_THREAD, stall_timeout_s=1.0))
    pid = engine.core_pid
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        with pytest.raises(EngineStalledError) as stalled:
            asyncio.run(_collect(engine, [1, 2, 3], params, "stall1"))
        assert time.monotonic() - stopped_at < 1.0 + 2.0
        assert re.fullmatch(
            r"engine core stalled: no message from it for \d+\.\d s \(stall timeout 1 s\)",
            str(stalled.value),
        ), stalled.value
        assert not engine.is_running and engine.dead_error is stalled.value
        with pytest.raises(EngineDeadError, match="stalled"):  # later requests: at once
            asyncio.run(_collect(engine, [1, 2, 3], params, "stall2"))
        start = time.monotonic()
        problem = engine.shutdown(timeout_s=30)
        assert time.monotonic() - start < 5
        assert problem == f"{stalled.value}; the engine core was killed by signal 9: its KV " \
            "offload was not drained"  # fmt: skip
        assert _gone(pid)
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        engine.shutdown()


def test_an_idle_core_is_no_stall_even_with_a_timeout_below_its_idle_stats_period(
    model_dir: str,
) -> None:
    """An idle core sends its stats every 5 s (engine.core.proc); with a 1 s stall timeout the
    client asks it for them after 0.5 s of silence, so 6 s of idling (one 5 s gap and six
    timeouts) is no stall and the core still serves."""
    engine = EngineCoreClient.start(_config(model_dir), replace(ONE_THREAD, stall_timeout_s=1.0))
    try:
        time.sleep(6)
        assert engine.is_running, engine.dead_error
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        outs = asyncio.run(_collect(engine, [1, 2, 3], params, "idle1"))
        assert outs[-1].finished
    finally:
        problem = engine.shutdown()
    assert problem is None


def test_startup_error_carries_the_core_message(model_dir: str) -> None:
    bad = _config(model_dir, max_num_batched_tokens=16, enable_chunked_prefill=False)
    with pytest.raises(EngineStartupError, match="without chunked prefill"):
        EngineCoreClient.start(bad, ONE_THREAD)


def test_kv_offload_stats_reach_metrics_from_the_core_process(model_dir: str) -> None:
    """A 24-block pool and five 100-token prompts: the first prompt's 6 full blocks are
    evicted to the host tier, and sending it again loads them back. The core's offload
    counters and per-tier rows show up in /metrics."""
    from tests.engine.test_server import _metric, run_server

    offload = {"decision": "load", "tiers": [{"kind": "host", "capacity": "8MiB"}]}
    config = replace(
        _config(model_dir), cache=CacheConfig(num_gpu_blocks=24),
        kv_offload=True, kv_offload_config=offload,
    )  # fmt: skip
    prompts = [[1, *range(10 + 90 * i, 109 + 90 * i)] for i in range(5)]
    engine = EngineCoreClient.start(config, ONE_THREAD)
    try:
        with run_server(engine, "kv") as url:
            for prompt in [*prompts, prompts[0]]:
                body = {"model": "kv", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
                assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
            text = httpx.get(f"{url}/metrics").text
    finally:
        engine.shutdown()
    assert _metric(text, "kvtier_kv_loaded_tokens_total") == 6 * 16
    host = '{model_name="kv",tier="host"}'
    assert _metric(text, "kvtier_prompt_tokens_cached_by_tier_total", host) == 6 * 16
    assert _metric(text, "kvtier_kv_tier_hits_total", host) == 6
    assert _metric(text, "kvtier_kv_saved_bytes_total") > 0
    assert "# TYPE kvtier_kv_loaded_tokens_total counter" in text


# --- the HTTP server on a slow model: responsiveness, disconnects, core death -----------------

SLOW = "slow"


def _long_prompt(shift: int) -> list[int]:
    """481 tokens; a different ``shift`` shares no prefix block with another (no cache hits)."""
    return [1, *range(3 + shift, 483 + shift)]


@dataclass
class SlowServer:
    base_url: str
    engine: EngineCoreClient


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlowServer]:
    """8 layers of width 256 and a 4-token step budget: a 481-token prefill takes 121 engine
    steps (over a second) in the core process, long enough for 10 health polls even on a
    loaded CI machine (8-token steps left 8 polls there once)."""
    from tests.engine.test_server import run_server

    model_dir = make_tiny_model(
        tmp_path_factory.mktemp("slow"), "llama", seed=2,
        hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
    )  # fmt: skip
    config = EngineConfig(
        model=model_dir,
        device="cpu",
        cache=CacheConfig(num_gpu_blocks=64),
        scheduler=SchedulerConfig(max_model_len=512, max_num_batched_tokens=4),
    )
    engine = EngineCoreClient.start(config, ONE_THREAD)
    try:
        with run_server(engine, SLOW) as base_url:
            yield SlowServer(base_url, engine)
    finally:
        engine.shutdown()


def test_health_answers_quickly_during_a_long_prefill(slow_server: SlowServer) -> None:
    engine = slow_server.engine
    before = _wait_idle(engine)["generation_tokens_total"]
    body = {"model": SLOW, "prompt": _long_prompt(0), "max_tokens": 2, "ignore_eos": True}
    request = threading.Thread(
        target=httpx.post, args=(f"{slow_server.base_url}/v1/completions",),
        kwargs={"json": body, "timeout": 60},
    )  # fmt: skip
    latencies: list[float] = []
    polls_during_prefill = 0
    with httpx.Client(base_url=slow_server.base_url, timeout=5) as http:
        http.get("/health")  # connect before timing
        request.start()
        deadline = time.monotonic() + 60
        while engine.stats()["generation_tokens_total"] == before:  # no token yet: prefill
            assert time.monotonic() < deadline
            start = time.monotonic()
            status = http.get("/health").status_code
            latencies.append(time.monotonic() - start)
            assert status == 200
            polls_during_prefill += engine.stats()["num_requests_running"] == 1
            time.sleep(0.02)
    request.join(60)
    # The prefill ran in the core for many polls, and not one poll waited on it.
    assert polls_during_prefill >= 10, (polls_during_prefill, latencies)
    assert max(latencies) < 0.2, sorted(latencies)[-5:]


def test_non_streaming_client_disconnect_aborts_in_the_core(
    slow_server: SlowServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The client leaves before its first token: the core aborts it, the server counts a 499
    and logs no traceback for it (a benchmark cut at its limit left one per open request)."""
    from tests.engine.test_server import _metric

    engine = slow_server.engine
    before = _wait_idle(engine)["generation_tokens_total"]
    gone = f'{{endpoint="/v1/completions",model_name="{SLOW}",status="499"}}'
    gone_before = _metric(
        httpx.get(f"{slow_server.base_url}/metrics").text, "kvtier_requests_total", gone
    )
    body = {"model": SLOW, "prompt": _long_prompt(1), "max_tokens": 30, "ignore_eos": True}
    with caplog.at_level(logging.ERROR):
        with pytest.raises(httpx.ReadTimeout):  # the client leaves during the prefill
            httpx.post(f"{slow_server.base_url}/v1/completions", json=body, timeout=0.3)
        after = _wait_idle(engine, timeout_s=30)["generation_tokens_total"]
        assert after - before < 30  # type: ignore[operator]
        deadline = time.monotonic() + 10
        while True:  # the server notices the disconnect on its next receive poll
            text = httpx.get(f"{slow_server.base_url}/metrics").text
            if _metric(text, "kvtier_requests_total", gone) == gone_before + 1:
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.05)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_killing_the_core_fails_pending_requests_and_health(slow_server: SlowServer) -> None:
    """Runs last on this server: it leaves the engine dead."""
    engine, url = slow_server.engine, slow_server.base_url
    _wait_idle(engine)
    stream_lines: list[str] = []
    first_chunk = threading.Event()
    responses: list[httpx.Response] = []

    def stream() -> None:
        body = {"model": SLOW, "prompt": [1, 7, 8], "max_tokens": 400, "ignore_eos": True,
                "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line:
                    stream_lines.append(line)
                    first_chunk.set()

    def prefill() -> None:
        body = {"model": SLOW, "prompt": _long_prompt(2), "max_tokens": 5, "ignore_eos": True}
        responses.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60))

    threads = [threading.Thread(target=stream), threading.Thread(target=prefill)]
    for t in threads:
        t.start()
    assert first_chunk.wait(30)
    deadline = time.monotonic() + 30
    while engine.stats()["num_requests_running"] < 2:  # both inside the core
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.01)
    os.kill(engine.core_pid, signal.SIGKILL)
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    # The streamed request already had its 200: the failure arrives in-band, then [DONE].
    assert stream_lines[-1] == "data: [DONE]"
    error = json.loads(stream_lines[-2].removeprefix("data: "))["error"]
    assert error["type"] == "service_unavailable" and "died" in error["message"]
    # The one still in prefill fails with 503 before any byte of a response.
    assert responses[0].status_code == 503
    assert "died (exit code -9)" in responses[0].json()["error"]["message"]
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and "died" in health.json()["error"]["message"]
    later = httpx.post(f"{url}/v1/completions", json={"model": SLOW, "prompt": [1, 2]})
    assert later.status_code == 503
    assert not engine.is_running and isinstance(engine.dead_error, EngineDeadError)


def test_the_core_engine_loads_no_tokenizer_unless_asked(model_dir: str, tmp_path) -> None:
    """The core (``detokenize=False``) builds and serves token ids without transformers'
    AutoTokenizer (~3.5 CPU s of its start; loaded at a first request, it stalled the core
    that long): its textless tokens come from tokenizer.json alone and equal the
    tokenizer's; the tokenizer loads when something asks for it; a directory without
    tokenizer files is still refused at construction. In a fresh interpreter, where nothing
    imported transformers before."""
    import subprocess
    import sys

    code = f"""
import sys
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.tokenizer import textless_token_ids
cfg = EngineConfig(model={model_dir!r}, device="cpu", cache=CacheConfig(num_gpu_blocks=64),
                   scheduler=SchedulerConfig(max_model_len=128))
engine = LLMEngine(cfg, detokenize=False)
from engine.sampling_params import SamplingParams
engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
while engine.has_unfinished_requests():
    engine.step()  # token ids in, token ids out: still no tokenizer
assert engine._tokenizer is None and "transformers" not in sys.modules, "loaded"
found = engine.textless_token_ids
assert found and found == textless_token_ids(engine.tokenizer, engine._vocab_size), "differ"
assert "transformers" in sys.modules and engine.tokenizer is engine.tokenizer
try:
    LLMEngine(EngineConfig(model={model_dir!r}, tokenizer={str(tmp_path)!r}, device="cpu",
                           cache=CacheConfig(num_gpu_blocks=64),
                           scheduler=SchedulerConfig(max_model_len=128)), detokenize=False)
except ValueError as exc:
    assert "cannot load a tokenizer" in str(exc) and "no tokenizer files" in str(exc), exc
else:
    raise AssertionError("a directory without tokenizer files was accepted")
print("ok")
"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        env=dict(os.environ, PYTHONPATH=root),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
