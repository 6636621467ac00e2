"""The real HTTP server (uvicorn on a loopback port, tiny random-weight llama, the engine core in
its own process as ``kvtier serve`` runs it) driven with the ``openai`` client: greedy results
equal ``LLM.generate``, streamed equals non-streamed, exact usage, metrics, concurrency,
disconnects and OpenAI-shaped 4xx errors."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.base import EngineClient
from engine.core.client import CoreProcConfig, EngineCoreClient
from engine.sampling_params import SamplingParams
from engine.server.api import build_app
from tests.engine.hf_models import make_tiny_model

pytestmark = pytest.mark.timeout(60)
MODEL = "tiny-llama"
MAX_MODEL_LEN = 128
PROMPT = "The cache keeps every block of the prompt"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Where does an evicted block go?"},
]


@dataclass
class Server:
    base_url: str
    engine: EngineClient
    llm: object  # engine.llm.LLM on the same weights and config, the reference

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0)


@contextmanager
def run_server(engine: EngineClient, served_model_name: str, **app_options: Any) -> Iterator[str]:
    """uvicorn serving ``engine`` on a free loopback port from a thread; yields the base URL.
    Leaves the engine running (its owner shuts it down). ``app_options`` go to build_app."""
    with run_app(build_app(engine, served_model_name, **app_options)) as base_url:
        yield base_url


@contextmanager
def run_app(app: Any) -> Iterator[str]:
    """uvicorn serving ``app`` on a free loopback port from a thread; yields the base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # a free port, held until uvicorn takes the socket over
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not uv.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from engine.llm import LLM

    model_dir = make_tiny_model(tmp_path_factory.mktemp("server"), "llama", seed=5)
    config = EngineConfig(
        model=model_dir,
        device="cpu",
        cache=CacheConfig(num_gpu_blocks=96),
        scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN),
    )
    # One torch thread in the core: this 2-core machine also runs the API and the reference.
    engine = EngineCoreClient.start(config, CoreProcConfig(num_threads=1))
    try:
        llm = LLM(model_dir, device="cpu", num_gpu_blocks=96, max_model_len=MAX_MODEL_LEN)
        with run_server(engine, MODEL) as base_url:
            yield Server(base_url, engine, llm)
    finally:
        engine.shutdown()


def _reference(server: Server, prompt: str | list[int], **params: object) -> object:
    sp = SamplingParams(temperature=0.0, **params)  # type: ignore[arg-type]
    return server.llm.generate([prompt], sp)[0]  # type: ignore[attr-defined]


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = (
        rf"^{re.escape(name)}{re.escape(labels)}\s+(\S+)$"
        if labels
        else rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)$"
    )
    match = re.search(pattern, text, re.M)
    return float(match.group(1)) if match else 0.0


def _wait_idle(server: Server, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = server.engine.stats()
        if stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"engine still busy: {server.engine.stats()}")


def test_models_and_health(server: Server) -> None:
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_completion_matches_llm_streamed_and_not(server: Server) -> None:
    ref = _reference(server, PROMPT, max_tokens=16, ignore_eos=True)
    client = server.client
    extra = {"ignore_eos": True}
    full = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body=extra
    )
    assert full.choices[0].text == ref.text
    assert full.choices[0].finish_reason == "length"
    assert full.model == MODEL and full.object == "text_completion"
    prompt_len = len(ref.prompt_token_ids)
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (prompt_len, 16)
    assert full.usage.total_tokens == prompt_len + 16

    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra,
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == prompt_len
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompt_and_stop_string(server: Server) -> None:
    ids = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56]
    ref = _reference(server, ids, max_tokens=10, ignore_eos=True)
    got = server.client.completions.create(
        model=MODEL, prompt=ids, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == ref.text
    assert got.usage.prompt_tokens == len(ids)
    # Stop on a piece of the greedy text: the server must cut exactly where LLM does.
    stop = ref.text[len(ref.text) // 2 :][:2]
    if not stop.strip():
        pytest.skip("greedy text has no usable stop string")  # pragma: no cover
    ref_stop = _reference(server, ids, max_tokens=10, ignore_eos=True, stop=(stop,))
    got_stop = server.client.completions.create(
        model=MODEL, prompt=ids, max_tokens=10, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert got_stop.choices[0].text == ref_stop.text
    assert got_stop.choices[0].finish_reason == "stop"
    assert stop not in got_stop.choices[0].text
    # vLLM's include_stop_str_in_output: the same cut, the stop string kept, streamed or not.
    with_stop = ref_stop.text + stop
    assert ref.text.startswith(with_stop)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 10, "temperature": 0, "stop": [stop],
            "ignore_eos": True, "include_stop_str_in_output": True}  # fmt: skip
    got_kept = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
    assert got_kept["choices"][0]["text"] == with_stop, got_kept
    assert got_kept["choices"][0]["finish_reason"] == "stop"
    assert got_kept["choices"][0]["stop_reason"] == stop
    chunks = server.client.completions.create(
        model=MODEL, prompt=ids, max_tokens=10, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == with_stop


def test_chat_matches_llm_streamed_and_not(server: Server) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = server.llm.chat(MESSAGES, sp)[0]  # type: ignore[attr-defined]
    client = server.client
    extra = {"ignore_eos": True}
    full = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=12, temperature=0, extra_body=extra
    )
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == ref.text
    assert full.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert full.usage.completion_tokens == 12
    assert full.object == "chat.completion"

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra,
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == len(ref.prompt_token_ids) + 12


def test_tokenizing_a_chat_leaves_the_event_loop_free(server: Server) -> None:
    """The chat's template and tokenizer run on the API's tokenizer thread: while they are
    held there, the event loop still answers (other streams' chunks would go on too); once
    released, the answer is the reference's."""
    app = build_app(server.engine, MODEL)
    ctx = app.state.ctx
    release, threads = threading.Event(), []
    real = ctx.chat_tokens.encode

    def held(conversation: Any, max_tokens: int | None = None) -> Any:
        threads.append(threading.current_thread().name)
        release.wait(20)
        return real(conversation, max_tokens)

    ctx.chat_tokens.encode = held
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    with run_app(app) as base_url, ThreadPoolExecutor(1) as pool:
        chat = pool.submit(httpx.post, f"{base_url}/v1/chat/completions", json=body, timeout=30)
        deadline = time.monotonic() + 10
        while not threads:
            assert time.monotonic() < deadline, "the chat request never reached its tokenizer"
            time.sleep(0.01)
        try:
            assert httpx.get(f"{base_url}/v1/models", timeout=5).status_code == 200
            assert not chat.done()
        finally:
            release.set()
        response = chat.result(30)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref = server.llm.chat(MESSAGES, sp)[0]  # type: ignore[attr-defined]
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == ref.text
    assert [name.startswith("kvtier-api-tokenize") for name in threads] == [True]


def test_the_return_log_has_each_requests_return_and_first_text(
    server: Server, tmp_path: Any
) -> None:
    """``return_log``: one line per request, by engine request id, once its first chunk with
    text went out; the first chunk never after the first text."""
    path = tmp_path / "run.api.jsonl"
    app = build_app(server.engine, MODEL, return_log=str(path))
    with run_app(app) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )
        )  # fmt: skip
        full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["req_id"] for line in lines] == [f"{chunks[0].id}-0", f"{full.id}-0"]
    for line in lines:
        assert 0.0 <= line["return_s"] <= line["first_text_s"] < 10.0


def test_default_max_tokens(server: Server) -> None:
    got = server.client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.usage.completion_tokens == 16  # OpenAI's completions default
    chat = server.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True}
    )
    # Chat without a budget generates up to the end of the context.
    assert chat.usage.total_tokens == MAX_MODEL_LEN
    assert chat.choices[0].finish_reason == "length"


def test_concurrent_streaming_clients(server: Server) -> None:
    prompts = [PROMPT, "Redis holds the blocks", "a b c d e f g", "S3 is slow but large"]
    refs = [_reference(server, p, max_tokens=14, ignore_eos=True).text for p in prompts]

    def stream(prompt: str) -> str:
        chunks = server.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=14, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(stream, prompts)) == refs


def test_batched_prompts_give_one_choice_each(server: Server) -> None:
    prompts = [PROMPT, "Redis holds the blocks"]
    refs = [_reference(server, p, max_tokens=9, ignore_eos=True) for p in prompts]
    extra = {"ignore_eos": True}
    full = server.client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=9, temperature=0, extra_body=extra
    )
    assert [(c.index, c.text) for c in full.choices] == [(0, refs[0].text), (1, refs[1].text)]
    num_prompt = sum(len(r.prompt_token_ids) for r in refs)
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (num_prompt, 18)
    texts = ["", ""]
    chunks = server.client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=9, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra,
    )  # fmt: skip
    usage = None
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == [refs[0].text, refs[1].text]
    assert usage is not None and usage.total_tokens == num_prompt + 18


def test_metrics_count_requests_and_tokens(server: Server) -> None:
    _wait_idle(server)
    before = httpx.get(f"{server.base_url}/metrics").text
    got = server.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    httpx.post(f"{server.base_url}/v1/completions", json={"model": "nope", "prompt": "x"})
    after_resp = httpx.get(f"{server.base_url}/metrics")
    assert after_resp.headers["content-type"].startswith("text/plain")
    after = after_resp.text
    ok = f'{{endpoint="/v1/completions",model_name="{MODEL}",status="200"}}'
    missing = f'{{endpoint="/v1/completions",model_name="{MODEL}",status="404"}}'
    assert (
        _metric(after, "kvtier_requests_total", ok)
        == _metric(before, "kvtier_requests_total", ok) + 1
    )
    assert (
        _metric(after, "kvtier_requests_total", missing)
        == _metric(before, "kvtier_requests_total", missing) + 1
    )
    gen = "kvtier_generation_tokens_total"
    assert _metric(after, gen) == _metric(before, gen) + got.usage.completion_tokens
    prompt = "kvtier_prompt_tokens_total"
    assert _metric(after, prompt) == _metric(before, prompt) + got.usage.prompt_tokens
    # The same prompt was served before: its full blocks are prefix-cache hits now.
    hit = "kvtier_prefix_cache_hits_total"
    assert _metric(after, hit) >= _metric(before, hit) + 16
    assert _metric(after, "kvtier_prefix_cache_queries_total") > 0
    for hist in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        name = f"kvtier_{hist}_seconds_count"
        assert _metric(after, name) > _metric(before, name)
    assert _metric(after, "kvtier_num_requests_running") == 0
    assert "kvtier_num_requests_waiting" in after


def test_client_disconnect_aborts_streaming_request(server: Server) -> None:
    _wait_idle(server)
    before = server.engine.stats()["generation_tokens_total"]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
    _wait_idle(server)
    assert server.engine.stats()["generation_tokens_total"] - before < 60


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ("/v1/chat/completions", {"model": "gpt-4", "messages": MESSAGES}, 404, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": "word " * 200}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 129}, 400, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": True}, 400, "logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": -5}, 400, "top_k"),
        ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        # Strict types, as OpenAI's: a number in a string, a float or a bool is no integer.
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5.0}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": True}, 400, "seed"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "0.5"}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "false"}, 400, "stream"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": "5"}, 400, "max_completion_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "n": -1}, 400, "n"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "top_logprobs": 3}, 400, "top_logprobs"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "top_p": 1.5}, 400, "top_p"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "stream": True, "temperature": -1}, 400, "temperature"),
        # Fields that change what the answer means are refused by name, never dropped.
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "response_format": {"type": "xml"}}, 400, "response_format"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}, 400, "response_format"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "response_format": {"type": "json_schema"}}, 400, "response_format"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "tool_choice": "required"}, 400, "tool_choice"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, 400, "tools"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "functions": [{"name": "f"}]}, 400, "functions"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 3}, 400, "best_of"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages.0.content.1"),
    ],
)  # fmt: skip
def test_errors_are_openai_shaped(
    server: Server, path: str, body: dict[str, object], status: int, param: str
) -> None:
    resp = httpx.post(f"{server.base_url}{path}", json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


@pytest.mark.parametrize(
    ("path", "extra", "param", "hint"),
    [
        ("/v1/chat/completions", {"guided_json": {"type": "object"}}, "guided_json", "response_format"),
        ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json", "response_format"),
        ("/v1/chat/completions", {"guided_choice": ["yes", "no"]}, "guided_choice", None),
        ("/v1/completions", {"guided_regex": "[0-9]+"}, "guided_regex", None),
        ("/v1/chat/completions", {"guided_grammar": "root ::= 'a'"}, "guided_grammar", None),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "a+"}}, "structured_outputs", "response_format"),
        ("/v1/chat/completions", {"use_beam_search": True}, "use_beam_search", None),
        ("/v1/completions", {"bad_words": ["x"]}, "bad_words", None),
        ("/v1/chat/completions", {"cache_salt": "tenant-a"}, "cache_salt", "prefix cache"),
        ("/v1/chat/completions", {"chat_template": "{{ x }}"}, "chat_template", "--chat-template"),
        ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message", None),
        ("/v1/completions", {"prompt_logprobs": 1}, "prompt_logprobs", "echo"),
        ("/v1/chat/completions", {"prompt_logprobs": 0}, "prompt_logprobs", "echo"),
    ],
)  # fmt: skip
def test_vllm_fields_that_change_the_answer_are_refused_by_name(
    server: Server, path: str, extra: dict[str, object], param: str, hint: str | None
) -> None:
    """vLLM's extensions kvtier does not implement were ignored with a 200: a client asking
    for a regex-constrained or beam-searched answer got free text that looked like one."""
    base = {"model": MODEL, "max_tokens": 2}
    base.update({"messages": MESSAGES} if "chat" in path else {"prompt": "x"})
    resp = httpx.post(f"{server.base_url}{path}", json={**base, **extra}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(param) and "\n" not in error["message"], error
    if hint:
        assert hint in error["message"], error


def test_harmless_forms_of_the_refused_fields_are_served(server: Server) -> None:
    """``response_format: text``, ``tool_choice: none`` (with tools: none can be called), text-only content parts and vLLM's
    extensions at their neutral values change nothing, so they are served (and answer as the
    plain request does)."""
    plain = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    want = httpx.post(f"{server.base_url}/v1/chat/completions", json=plain, timeout=60).json()
    parts = [
        {"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES
    ]
    for extra in (
        {"response_format": {"type": "text"}},
        {"tool_choice": "none", "tools": []},
        {"tool_choice": "none", "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"function_call": "none", "functions": [{"name": "f", "parameters": {}}]},
        {"messages": parts},
        # vLLM's extensions at their neutral values (what vLLM does without them).
        {"use_beam_search": False, "prompt_logprobs": None},
        {"add_generation_prompt": True, "continue_final_message": False, "guided_json": None},
    ):
        got = httpx.post(
            f"{server.base_url}/v1/chat/completions", json={**plain, **extra}, timeout=60
        )
        assert got.status_code == 200, (extra, got.text)
        assert got.json()["choices"][0]["message"] == want["choices"][0]["message"], extra


def test_api_key_cors_version_and_model_card(server: Server) -> None:
    """``--api-key``: /v1/* needs the bearer key (401 otherwise, OpenAI-shaped), probes stay
    open; ``--allowed-origins``: CORS answers for that origin only."""
    with run_server(
        server.engine, MODEL, api_key="sk-test-123", allowed_origins=("https://app.example",)
    ) as base:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        no_key = httpx.post(f"{base}/v1/completions", json=body)
        assert (
            no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
        )
        wrong = httpx.get(f"{base}/v1/models", headers={"authorization": "Bearer sk-nope"})
        assert wrong.status_code == 401
        ok = httpx.post(
            f"{base}/v1/completions",
            json=body,
            headers={"authorization": "Bearer sk-test-123"},
            timeout=60,
        )
        assert ok.status_code == 200
        assert openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test-123").models.list().data
        assert httpx.get(f"{base}/health").status_code == 200  # probes need no key
        assert httpx.get(f"{base}/version").json()["version"]
        pre = httpx.options(
            f"{base}/v1/completions",
            headers={"origin": "https://app.example", "access-control-request-method": "POST"},
        )
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(
            f"{base}/v1/completions",
            headers={"origin": "https://evil.example", "access-control-request-method": "POST"},
        )
        assert "access-control-allow-origin" not in other.headers
    card = httpx.get(f"{server.base_url}/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["max_model_len"] == MAX_MODEL_LEN
    missing = httpx.get(f"{server.base_url}/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_openai_client_raises_typed_errors(server: Server) -> None:
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        server.client.completions.create(model=MODEL, prompt="word " * 200)
    resp = httpx.get(f"{server.base_url}/no/such/route")
    assert resp.status_code == 404 and resp.json()["error"]["message"] == "Not Found"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "ab\ud800cd"}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["ok", "x\udfff"]}, "prompt.1"),
        ("/v1/completions", {"model": "m\ud800", "prompt": "x"}, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["\ud800"]}, "stop.0"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [
            MESSAGES[0], {"role": "user", "content": "hi \udc00"}]}, "messages.1.content"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**200}, "seed"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": -(2**64)}, "seed"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2**70}, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 2**64}, "top_k"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2**40]}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [-1]},
         "stop_token_ids.0"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "seed": 2**63},
         "seed"),
    ],
)  # fmt: skip
def test_invalid_unicode_and_huge_integers_are_400(
    server: Server, path: str, body: dict[str, object], param: str
) -> None:
    """Issue 16 F4: a lone surrogate (valid JSON, invalid Unicode) or an integer past 64 bits
    is a 400 naming the field, not a 500."""
    import json

    content = json.dumps(body)  # ensure_ascii: the surrogate goes as a \\u escape
    resp = httpx.post(
        f"{server.base_url}{path}", content=content, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    # Still serving.
    assert server.client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"model": "tiny-llama", "prompt": }', "invalid JSON body: Expecting value at character 34"),
        (b'{"model": "tiny-llama", "prompt": "x",}', "invalid JSON body: Expecting property name enclosed in double quotes at character 38"),
        (b"", "missing JSON body: expected a JSON object"),
    ],
)  # fmt: skip
def test_invalid_json_body_is_a_clear_400_naming_no_field(
    server: Server, content: bytes, message: str
) -> None:
    resp = httpx.post(
        f"{server.base_url}/v1/completions",
        content=content,
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error == {
        "message": message,
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


def test_body_cap_and_length_bound_before_tokenization(server: Server) -> None:
    """Issue 16 F3: a body over the cap is 413 (declared or chunked) before it is parsed; a
    long prompt within the cap is refused after tokenizing a small part of it."""
    url = f"{server.base_url}/v1/completions"
    big = b'{"model": "tiny-llama", "prompt": "' + b"w" * (17 << 20) + b'"}'
    resp = httpx.post(url, content=big, headers={"content-type": "application/json"})
    assert resp.status_code == 413 and "limit" in resp.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(17):
            yield b"w" * (1 << 20)
        yield b'"}'

    resp = httpx.post(url, content=chunks(), headers={"content-type": "application/json"})
    assert resp.status_code == 413, resp.text
    t0 = time.monotonic()
    resp = httpx.post(url, json={"model": MODEL, "prompt": "word " * (2 << 20)}, timeout=60)
    elapsed = time.monotonic() - t0
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text
    assert "maximum context length" in resp.json()["error"]["message"]
    # 10 MB of text: tokenizing it whole takes seconds here; the bound reads one 4 KiB piece.
    assert elapsed < 2.0, elapsed
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "word " * (2 << 20)}]}
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages", resp.text
