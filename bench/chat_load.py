"""Concurrent multi-round chat users against an OpenAI-compatible server (``kvtier serve``),
over HTTP with streaming, as a user's client drives it. Shared by bench/soak.py.

Each user holds a conversation: a system prompt (a prefix shared by all users, then its own
part), then rounds of a question of ``question_tokens`` new tokens (random words; the words per
token are learned from the server's ``usage``) and an answer of ``answer_len`` tokens. When the
next round would pass ``max_context`` tokens, the user starts a new conversation. Per request:
TTFT (first content chunk), inter-token latencies, prompt tokens, failure reason.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
WORDS_PER_TOKEN = 0.2  # the demo tokenizer: ~5 tokens per random word; refined per user from usage


def words(rng: random.Random, n: int) -> str:
    return " ".join(
        "".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 8))) for _ in range(n)
    )


@dataclass(slots=True)
class RequestRecord:
    """One request of a load generator (bench/soak.py, bench/serving.py): what
    ``stream_chat`` measured."""

    user: int
    round: int
    start_s: float  # since the load started
    ok: bool = False
    req_id: str = ""
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    end_s: float | None = None  # since the load started: the last byte of the response


@dataclass(frozen=True, slots=True)
class ChatLoad:
    base_url: str
    model: str
    users: int
    duration_s: float
    max_context: int = 32768
    shared_system_tokens: int = 2000
    user_system_tokens: int = 1000
    question_tokens: int = 2000
    answer_len: int = 64
    think_s: float = 0.5
    request_timeout_s: float = 300.0
    seed: int = 0


async def stream_chat(
    http: httpx.AsyncClient, body: dict[str, Any], rec: RequestRecord, timeout_s: float
) -> str:
    """One streaming ``/v1/chat/completions`` request of ``body`` (``stream`` and
    ``include_usage`` are set here); fills ``rec`` (TTFT at the first content chunk, the gaps
    after it, usage, the response id, the failure). Returns the answer text."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    text: list[str] = []
    start = time.perf_counter()
    last = None
    async with http.stream("POST", "/v1/chat/completions", json=body, timeout=timeout_s) as resp:
        if resp.status_code != 200:
            rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return ""
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                rec.error = f"stream error: {chunk['error']}"[:200]
                return ""
            rec.req_id = chunk.get("id", rec.req_id)
            if chunk.get("usage"):
                rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
                rec.completion_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    now = time.perf_counter()
                    if last is None:
                        rec.ttft_s = now - start
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                    text.append(delta)
    rec.ok = rec.ttft_s is not None and not rec.error
    if not rec.ok and not rec.error:
        rec.error = "no content"
    return "".join(text)


async def _one_request(
    http: httpx.AsyncClient,
    load: ChatLoad,
    messages: list[dict[str, str]],
    rec: RequestRecord,
    t0: float,
) -> str:
    body = {
        "model": load.model,
        "messages": messages,
        "max_tokens": load.answer_len,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    return await stream_chat(http, body, rec, load.request_timeout_s)


async def _user(
    load: ChatLoad, uid: int, shared: str, records: list[RequestRecord], t0: float
) -> None:
    rng = random.Random(load.seed * 1000 + uid)
    words_per_token = WORDS_PER_TOKEN  # refined from usage
    async with httpx.AsyncClient(base_url=load.base_url) as http:
        conv = 0
        while time.perf_counter() - t0 < load.duration_s:
            system = shared + " " + words(rng, int(load.user_system_tokens * WORDS_PER_TOKEN))
            messages = [{"role": "system", "content": system}]
            tokens, rnd = 0, 0
            conv += 1
            while time.perf_counter() - t0 < load.duration_s:
                n_words = max(1, int(load.question_tokens * words_per_token))
                if (
                    tokens
                    and tokens + 1.2 * load.question_tokens + load.answer_len + 128
                    > load.max_context
                ):
                    break
                messages.append({"role": "user", "content": words(rng, n_words)})
                rec = RequestRecord(uid, rnd, time.perf_counter() - t0)
                try:
                    answer = await _one_request(http, load, messages, rec, t0)
                except (httpx.HTTPError, json.JSONDecodeError) as exc:
                    rec.error = f"{type(exc).__name__}: {exc}"[:200]
                    answer = ""
                records.append(rec)
                if not rec.ok:
                    if "maximum context length" in rec.error:
                        break  # over the model's context: a new conversation
                    await asyncio.sleep(load.think_s)
                    break
                if rec.prompt_tokens > tokens:
                    added = rec.prompt_tokens - tokens
                    words_per_token = 0.7 * words_per_token + 0.3 * (n_words / max(1, added))
                tokens = rec.prompt_tokens + rec.completion_tokens
                messages.append({"role": "assistant", "content": answer})
                rnd += 1
                await asyncio.sleep(rng.uniform(0, 2 * load.think_s))


async def _health(
    base_url: str, t0: float, duration_s: float, samples: list[tuple[float, int]]
) -> None:
    async with httpx.AsyncClient(base_url=base_url) as http:
        while time.perf_counter() - t0 < duration_s:
            try:
                code = (await http.get("/health", timeout=5)).status_code
            except httpx.HTTPError:
                code = 0
            samples.append((round(time.perf_counter() - t0, 1), code))
            await asyncio.sleep(1.0)


async def run_load(load: ChatLoad) -> dict[str, Any]:
    """Runs the users for ``duration_s`` (the rounds in flight then finish); returns the
    records and /health samples."""
    t0 = time.perf_counter()
    shared = words(random.Random(load.seed), int(load.shared_system_tokens * WORDS_PER_TOKEN))
    records: list[RequestRecord] = []
    health: list[tuple[float, int]] = []
    await asyncio.gather(
        _health(load.base_url, t0, load.duration_s, health),
        *(_user(load, u, shared, records, t0) for u in range(load.users)),
    )
    return {"records": records, "health": health, "wall_s": time.perf_counter() - t0}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    recs: list[RequestRecord] = result["records"]
    ok = [r for r in recs if r.ok]
    ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    itl = [x * 1e3 for r in ok for x in r.itl_s]
    codes: dict[str, int] = {}
    for _, c in result["health"]:
        codes[str(c)] = codes.get(str(c), 0) + 1
    errors: dict[str, int] = {}
    for r in recs:
        if not r.ok:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    return {
        "requests": len(recs),
        "failed": len(recs) - len(ok),
        "errors": errors,
        "max_prompt_tokens": max((r.prompt_tokens for r in ok), default=0),
        "prompt_tokens_p50": pct([float(r.prompt_tokens) for r in ok], 50),
        "ttft_ms": {f"p{q}": pct(ttft, q) for q in (50, 90, 99)},
        "itl_ms": {f"p{q}": pct(itl, q) for q in (50, 90, 99)},
        "generated_tokens": sum(r.completion_tokens for r in ok),
        "health": codes,
        "health_samples": len(result["health"]),
        "wall_s": round(result["wall_s"], 1),
    }
