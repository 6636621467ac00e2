"""``/v1/completions`` and ``/v1/chat/completions``: JSON and SSE responses built from engine
outputs. Both tokenize in the server (the engine receives token ids), so prompt length is
checked, and usage counted, on exactly the ids the engine runs."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.chat_tokens import EncodedChat
from engine.core.base import EngineDeadError
from engine.outputs import RequestOutput
from engine.server.errors import error_body
from engine.server.logprobs import merge_completion
from engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    SamplingRequest,
)
from engine.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
)
from engine.server.serving import (
    DONE_LINE,
    ServingContext,
    StartedRequest,
    collect_final,
    finish_reason,
    given_request_id,
    merge,
    new_request_id,
    running_usage,
    sse,
    stop_reason,
    unless_disconnected,
    usage_of,
)
from engine.tokenizer import TooManyTokens, encode_prompt
from engine.ttft import api_times

logger = logging.getLogger(__name__)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _token_bound(ctx: ServingContext, request: SamplingRequest) -> int | None:
    """The length past which a prompt is refused before it is tokenized whole; None when
    ``truncate_prompt_tokens`` keeps only its tail (``ServingContext.prepare``)."""
    return None if request.truncate_prompt_tokens is not None else ctx.engine.max_model_len


def _encode_chat(ctx: ServingContext, request: ChatCompletionRequest) -> EncodedChat:
    conversation, options = request.conversation(), request.template_options()
    bound = _token_bound(ctx, request)
    try:
        if options:  # rendered with other options than the token cache's entries
            return ctx.chat_tokens.encode_once(conversation, bound, **options)
        return ctx.chat_tokens.encode(conversation, bound)
    except TooManyTokens as exc:
        raise ctx.too_long(exc.at_least, "messages") from None
    except ValueError as exc:  # no chat template, or the template rejected the messages
        raise ProtocolError(f"cannot apply the chat template: {exc}", "messages") from exc


def _encode_prompts(
    ctx: ServingContext, request: CompletionRequest, prompts: list[str | list[int]]
) -> list[list[int]]:
    bound = _token_bound(ctx, request)
    try:
        return [encode_prompt(ctx.engine.tokenizer, p, bound) for p in prompts]
    except TooManyTokens as exc:
        raise ctx.too_long(exc.at_least, "prompt") from None


async def _error_tail(exc: BaseException) -> AsyncIterator[str]:
    kind = "service_unavailable" if isinstance(exc, EngineDeadError) else "server_error"
    yield sse(error_body(str(exc), kind))


def _echo_text(
    ctx: ServingContext, prompt: str | list[int], token_ids: list[int], request: CompletionRequest
) -> str:
    """The prompt as sent, or the text of the tokens kept when it was truncated."""
    if isinstance(prompt, str) and request.truncate_prompt_tokens is None:
        return prompt
    return ctx.engine.tokenizer.decode(token_ids)


def _completion_logprobs(
    ctx: ServingContext,
    request: CompletionRequest,
    output: RequestOutput,
    echo_text: str | None,
    *,
    new_only: bool = False,
    text_offset: int = 0,
) -> CompletionLogprobs | None:
    """The choice's logprobs (None unless asked): the echoed prompt's first (when
    ``echo_text`` is given), then the generated tokens' (this output's only if ``new_only``)."""
    if request.logprobs is None:
        return None
    entries = (output.new_logprobs if new_only else output.logprobs) or []
    ids = output.new_token_ids if new_only else output.token_ids
    n = min(len(entries), len(ids))
    offset = text_offset + (len(echo_text) if echo_text is not None else 0)
    formatter = ctx.logprobs.for_request(request.return_tokens_as_token_ids)
    generated = formatter.completion(entries[:n], ids[:n], offset)
    if echo_text is None:
        return generated
    prompt_entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
    prompt = formatter.completion(prompt_entries, output.prompt_token_ids, text_offset)
    return merge_completion(prompt, generated)


async def create_completion(
    ctx: ServingContext, request: CompletionRequest, raw: Request
) -> Response:
    request.check_text()
    ctx.check_model(request)
    request.check_supported()
    t0 = time.perf_counter()
    raw_prompts = request.prompts()
    encoded = await ctx.run_tokenizer(_encode_prompts, ctx, request, raw_prompts)
    prompts = [ctx.prepare(request, ids) for ids in encoded]
    times = api_times(0.0, time.perf_counter() - t0)
    echoes = [
        _echo_text(ctx, p, prepared.token_ids, request) if request.echo else None
        for p, prepared in zip(raw_prompts, prompts, strict=True)
    ]
    request_id, engine_id = new_request_id("cmpl", given_request_id(raw, request))
    started = await unless_disconnected(raw, ctx.start(engine_id, prompts, request, times))
    if request.stream:
        return StreamingResponse(
            _completion_stream(ctx, request_id, request, started, echoes),
            media_type="text/event-stream",
            headers=_SSE_HEADERS,
        )
    finals = await unless_disconnected(raw, asyncio.gather(*(collect_final(s) for s in started)))
    choices = []
    for i, o in enumerate(finals):
        echo = echoes[i // request.n]
        choices.append(
            CompletionChoice(
                index=i,
                text=(echo or "") + o.text,
                finish_reason=finish_reason(o),
                stop_reason=stop_reason(o),
                logprobs=_completion_logprobs(ctx, request, o, echo),
            )
        )
    response = CompletionResponse(
        id=request_id,
        model=ctx.served_model_name,
        choices=choices,
        usage=usage_of(finals, request.n),
    )
    return JSONResponse(response.model_dump())


async def _completion_stream(
    ctx: ServingContext,
    request_id: str,
    request: CompletionRequest,
    started: list[StartedRequest],
    echoes: list[str | None],
) -> AsyncIterator[str]:
    finals = {}
    sent_chars: dict[int, int] = {}  # per choice: characters sent so far (text_offset)
    try:
        async for index, output in merge(started):
            first = index not in sent_chars
            echo = echoes[index // request.n] if first else None
            logprobs = _completion_logprobs(
                ctx, request, output, echo, new_only=True, text_offset=sent_chars.get(index, 0)
            )
            text = (echo or "") + output.new_text
            sent_chars[index] = sent_chars.get(index, 0) + len(text)
            if text or output.finished or (logprobs is not None and logprobs.tokens):
                chunk = CompletionResponse(
                    id=request_id,
                    model=ctx.served_model_name,
                    choices=[
                        CompletionChoice(
                            index=index,
                            text=text,
                            finish_reason=finish_reason(output),
                            stop_reason=stop_reason(output),
                            logprobs=logprobs,
                        )
                    ],
                    usage=running_usage(output) if request.continuous_usage else None,
                )
                yield sse(chunk)
            if output.finished:
                finals[index] = output
    except Exception as exc:  # noqa: BLE001 - status 200 is already sent: report in-band
        logger.warning("completion stream %s failed: %r", request_id, exc)
        async for line in _error_tail(exc):
            yield line
    else:
        if request.include_usage:
            usage = usage_of([finals[i] for i in sorted(finals)], request.n)
            yield sse(
                CompletionResponse(
                    id=request_id, model=ctx.served_model_name, choices=[], usage=usage
                )
            )
    yield DONE_LINE


async def create_chat_completion(
    ctx: ServingContext, request: ChatCompletionRequest, raw: Request
) -> Response:
    request.check_text()
    ctx.check_model(request)
    request.check_supported()
    encoded = await ctx.run_tokenizer(_encode_chat, ctx, request)
    prompts = [ctx.prepare(request, encoded.token_ids)]
    times = api_times(encoded.template_s, encoded.tokenize_s)
    request_id, engine_id = new_request_id("chatcmpl", given_request_id(raw, request))
    started = await unless_disconnected(raw, ctx.start(engine_id, prompts, request, times))
    if request.stream:
        return StreamingResponse(
            _chat_stream(ctx, request_id, request, started),
            media_type="text/event-stream",
            headers=_SSE_HEADERS,
        )
    finals = await unless_disconnected(raw, asyncio.gather(*(collect_final(s) for s in started)))
    formatter = ctx.logprobs.for_request(request.return_tokens_as_token_ids)
    response = ChatCompletionResponse(
        id=request_id,
        model=ctx.served_model_name,
        choices=[
            ChatChoice(
                index=i,
                message=AssistantMessage(content=o.text),
                finish_reason=finish_reason(o),
                stop_reason=stop_reason(o),
                logprobs=formatter.chat(o.logprobs or []) if request.logprobs else None,
            )
            for i, o in enumerate(finals)
        ],
        usage=usage_of(finals, request.n),
    )
    return JSONResponse(response.model_dump())


async def _chat_stream(
    ctx: ServingContext,
    request_id: str,
    request: ChatCompletionRequest,
    started: list[StartedRequest],
) -> AsyncIterator[str]:
    def chunk(
        index: int,
        delta: DeltaMessage,
        reason: str | None,
        logprobs: ChatLogprobs | None = None,
        stopped_by: int | str | None = None,
        output: RequestOutput | None = None,
    ) -> str:
        """``output``: the choice's state, for ``continuous_usage_stats`` (None: the role
        chunk, before any token)."""
        choice = ChatStreamChoice(
            index=index,
            delta=delta,
            finish_reason=reason,
            stop_reason=stopped_by,
            logprobs=logprobs,
        )
        usage = None
        if request.continuous_usage and output is not None:
            usage = running_usage(output, count_tokens=delta.role is None)
        return sse(
            ChatCompletionChunk(
                id=request_id, model=ctx.served_model_name, choices=[choice], usage=usage
            )
        )

    formatter = ctx.logprobs.for_request(request.return_tokens_as_token_ids)
    for s in started:
        yield chunk(s.index, DeltaMessage(role="assistant", content=""), None, output=s.first)
    finals = {}
    try:
        async for index, output in merge(started):
            logprobs = None
            if request.logprobs and output.new_logprobs:
                logprobs = formatter.chat(output.new_logprobs)
            delta = DeltaMessage(content=output.new_text)
            if output.finished:  # its last text, if any, in the chunk that ends it (as vLLM)
                finals[index] = output
                yield chunk(
                    index, delta, finish_reason(output), logprobs, stop_reason(output), output
                )
            elif output.new_text or logprobs is not None:
                yield chunk(index, delta, None, logprobs, output=output)
    except Exception as exc:  # noqa: BLE001 - status 200 is already sent: report in-band
        logger.warning("chat stream %s failed: %r", request_id, exc)
        async for line in _error_tail(exc):
            yield line
    else:
        if request.include_usage and len(finals) == len(started):
            usage = usage_of([finals[i] for i in sorted(finals)], request.n)
            yield sse(
                ChatCompletionChunk(
                    id=request_id, model=ctx.served_model_name, choices=[], usage=usage
                )
            )
    yield DONE_LINE
