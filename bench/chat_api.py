"""API-side time per chat request, without the engine: what the API process spends on one
request of a multi-round conversation (chat template, tokenizing, the request message to the
core, detokenizing the answer and framing it as SSE chunks), with the demo tokenizer.

Usage: python -m bench.chat_api [--context-tokens 16384] [--conversations 8]
       [--question-tokens 1000] [--answer-len 100] [--out FILE]

Each conversation grows round by round (random words, ~5 demo tokens each, as bench/chat_load.py
sends) until its prompt passes ``--context-tokens``; only the rounds at or past
``--measure-from`` of that length are measured. Per request and per path (``cached``: the
server's ChatTokenCache; ``full``: ``encode_chat``, the whole conversation every round):
p50/p90 of template, tokenize, request encoding (msgpack), detokenize + SSE and their total.
The answer is fed one token per step through the API's RequestState, as the core streams it.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from bench.chat_load import words
from bench.common import emit_report, machine_info, percentile
from engine.chat_tokens import ChatTokenCache
from engine.core.messages import AddRequest, CoreOutput, encode_request
from engine.core.output_processor import RequestState
from engine.models.demo_model import build_demo_tokenizer
from engine.sampling_params import SamplingParams
from engine.server.responses import ChatCompletionChunk, ChatStreamChoice, DeltaMessage
from engine.server.serving import sse
from engine.tokenizer import NO_TOKENIZER_LIMIT, encode_chat

WORDS_PER_TOKEN = 0.2


def _stream_answer(tok: Any, prompt_ids: list[int], answer_ids: list[int]) -> None:
    """What the API does with one answer: per step, RequestState (detokenize) and one SSE
    chunk, as endpoints._chat_stream frames it."""
    params = SamplingParams(max_tokens=len(answer_ids))
    state = RequestState.new(tok, "r", prompt_ids, params, 0.0)
    for i, token_id in enumerate(answer_ids):
        last = i == len(answer_ids) - 1
        out = CoreOutput(
            "r",
            [token_id],
            last,
            "length" if last else None,
            None,
            0,
            0.0,
            0.0,
            0.0 if last else None,
        )
        output = state.process(out).output
        if output.new_text:
            choice = ChatStreamChoice(index=0, delta=DeltaMessage(content=output.new_text))
            sse(ChatCompletionChunk(id="r", model="m", choices=[choice]))


def _measure(
    tok: Any, conv: list[dict[str, str]], answer_ids: list[int], cache: ChatTokenCache | None
) -> tuple[dict[str, float], list[int]]:
    if cache is not None:
        enc = cache.encode(conv)
        ids, template_s, tokenize_s = enc.token_ids, enc.template_s, enc.tokenize_s
    else:
        t0 = time.perf_counter()
        ids = encode_chat(tok, conv)
        tokenize_s, template_s = time.perf_counter() - t0, 0.0  # both, not split here
    t0 = time.perf_counter()
    encode_request(AddRequest("r", ids, SamplingParams(max_tokens=len(answer_ids)), 0.0))
    t1 = time.perf_counter()
    _stream_answer(tok, ids, answer_ids)
    t2 = time.perf_counter()
    times = {
        "template_ms": template_s * 1e3,
        "tokenize_ms": tokenize_s * 1e3,
        "request_msg_ms": (t1 - t0) * 1e3,
        "detok_sse_ms": (t2 - t1) * 1e3,
    }
    times["total_ms"] = sum(times.values())
    return times, ids


def run(args: argparse.Namespace) -> dict[str, Any]:
    tok = build_demo_tokenizer()
    tok.model_max_length = NO_TOKENIZER_LIMIT  # as load_tokenizer does: no length warning
    measured: dict[str, list[dict[str, float]]] = {"cached": [], "full": []}
    prompt_tokens: list[int] = []
    cache = ChatTokenCache(tok)
    for c in range(args.conversations):
        rng = random.Random(c)
        conv = [{"role": "system", "content": words(rng, int(800 * WORDS_PER_TOKEN * 5))}]
        while True:
            conv.append(
                {"role": "user", "content": words(rng, int(args.question_tokens * WORDS_PER_TOKEN))}
            )
            answer = words(rng, int(args.answer_len * WORDS_PER_TOKEN))
            answer_ids = tok.encode(answer, add_special_tokens=False)[: args.answer_len]
            cached, ids = _measure(tok, conv, answer_ids, cache)
            full, full_ids = _measure(tok, conv, answer_ids, None)
            if ids != full_ids:
                raise AssertionError(f"cached ids differ from the full path at {len(ids)} tokens")
            if len(ids) >= args.measure_from * args.context_tokens:
                measured["cached"].append(cached)
                measured["full"].append(full)
                prompt_tokens.append(len(ids))
            if len(ids) >= args.context_tokens:
                break
            conv.append({"role": "assistant", "content": tok.decode(answer_ids)})
    paths = {
        path: {
            key: {f"p{q}": round(percentile(sorted(r[key] for r in rows), q), 3) for q in (50, 90)}
            for key in rows[0]
        }
        for path, rows in measured.items()
    }
    p50 = {path: paths[path]["total_ms"]["p50"] for path in paths}
    return {
        "machine": machine_info(),
        "tokenizer": "demo byte-level BPE (engine/models/demo_model.py)",
        "context_tokens": args.context_tokens,
        "answer_len": args.answer_len,
        "requests_measured": len(prompt_tokens),
        "prompt_tokens": {"min": min(prompt_tokens), "max": max(prompt_tokens)},
        "paths": paths,
        "cache_hits": cache.num_hits,
        "cache_misses": cache.num_misses,
        "guard_failures": cache.num_guard_failures,
        "summary": (
            f"chat_api: {len(prompt_tokens)} requests of {min(prompt_tokens)}-"
            f"{max(prompt_tokens)} tokens, {args.answer_len}-token answers: API-side "
            f"p50 {p50['cached']:.2f} ms with the token cache, {p50['full']:.2f} ms "
            f"re-tokenizing (CPU: {machine_info()['cpu_model']})"
        ),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context-tokens", type=int, default=16384)
    ap.add_argument(
        "--measure-from",
        type=float,
        default=0.75,
        help="measure rounds whose prompt is at least this fraction of the context",
    )
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--question-tokens", type=int, default=1000)
    ap.add_argument("--answer-len", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    emit_report(run(args), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
