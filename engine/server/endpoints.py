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
from engine.server.errors import error_body
from engine.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ProtocolError,
)
from engine.server.serving import (
    DONE_LINE,
    ServingContext,
    StartedRequest,
    collect_final,
    finish_reason,
    merge,
    new_request_id,
    sse,
    unless_disconnected,
    usage_of,
)
from engine.tokenizer import TooManyTokens, encode_prompt
from engine.ttft import api_times

logger = logging.getLogger(__name__)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _encode_chat(ctx: ServingContext, conversation: list[dict[str, str]]) -> EncodedChat:
    try:
        return ctx.chat_tokens.encode(conversation, ctx.engine.max_model_len)
    except TooManyTokens as exc:
        raise ctx.too_long(exc.at_least, "messages") from None
    except ValueError as exc:  # no chat template, or the template rejected the messages
        raise ProtocolError(f"cannot apply the chat template: {exc}", "messages") from exc


def _encode_prompt(ctx: ServingContext, prompt: str | list[int]) -> list[int]:
    try:
        return encode_prompt(ctx.engine.tokenizer, prompt, ctx.engine.max_model_len)
    except TooManyTokens as exc:
        raise ctx.too_long(exc.at_least, "prompt") from None


async def _error_tail(exc: BaseException) -> AsyncIterator[str]:
    kind = "service_unavailable" if isinstance(exc, EngineDeadError) else "server_error"
    yield sse(error_body(str(exc), kind))


async def create_completion(
    ctx: ServingContext, request: CompletionRequest, raw: Request
) -> Response:
    request.check_text()
    ctx.check_model(request)
    request.check_supported()
    t0 = time.perf_counter()
    prompts = [ctx.prepare(request, _encode_prompt(ctx, p)) for p in request.prompts()]
    times = api_times(0.0, time.perf_counter() - t0)
    request_id = new_request_id("cmpl")
    started = await unless_disconnected(raw, ctx.start(request_id, prompts, request, times))
    if request.stream:
        return StreamingResponse(
            _completion_stream(ctx, request_id, request, started),
            media_type="text/event-stream",
            headers=_SSE_HEADERS,
        )
    finals = await unless_disconnected(raw, asyncio.gather(*(collect_final(s) for s in started)))
    response = CompletionResponse(
        id=request_id,
        model=ctx.served_model_name,
        choices=[
            CompletionChoice(index=i, text=o.text, finish_reason=finish_reason(o))
            for i, o in enumerate(finals)
        ],
        usage=usage_of(finals),
    )
    return JSONResponse(response.model_dump())


async def _completion_stream(
    ctx: ServingContext, request_id: str, request: CompletionRequest, started: list[StartedRequest]
) -> AsyncIterator[str]:
    finals = {}
    try:
        async for index, output in merge(started):
            if output.new_text or output.finished:
                chunk = CompletionResponse(
                    id=request_id,
                    model=ctx.served_model_name,
                    choices=[
                        CompletionChoice(
                            index=index, text=output.new_text, finish_reason=finish_reason(output)
                        )
                    ],
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
            usage = usage_of([finals[i] for i in sorted(finals)])
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
    encoded = _encode_chat(ctx, request.conversation())
    prompts = [ctx.prepare(request, encoded.token_ids)]
    times = api_times(encoded.template_s, encoded.tokenize_s)
    request_id = new_request_id("chatcmpl")
    started = await unless_disconnected(raw, ctx.start(request_id, prompts, request, times))
    if request.stream:
        return StreamingResponse(
            _chat_stream(ctx, request_id, request, started[0]),
            media_type="text/event-stream",
            headers=_SSE_HEADERS,
        )
    final = await unless_disconnected(raw, collect_final(started[0]))
    response = ChatCompletionResponse(
        id=request_id,
        model=ctx.served_model_name,
        choices=[
            ChatChoice(
                index=0,
                message=AssistantMessage(content=final.text),
                finish_reason=finish_reason(final),
            )
        ],
        usage=usage_of([final]),
    )
    return JSONResponse(response.model_dump())


async def _chat_stream(
    ctx: ServingContext, request_id: str, request: ChatCompletionRequest, started: StartedRequest
) -> AsyncIterator[str]:
    def chunk(delta: DeltaMessage, reason: str | None) -> str:
        choice = ChatStreamChoice(index=0, delta=delta, finish_reason=reason)
        return sse(
            ChatCompletionChunk(id=request_id, model=ctx.served_model_name, choices=[choice])
        )

    yield chunk(DeltaMessage(role="assistant", content=""), None)
    final = None
    try:
        async for output in started.outputs():
            if output.new_text:
                yield chunk(DeltaMessage(content=output.new_text), None)
            if output.finished:
                final = output
                yield chunk(DeltaMessage(), finish_reason(output))
    except Exception as exc:  # noqa: BLE001 - status 200 is already sent: report in-band
        logger.warning("chat stream %s failed: %r", request_id, exc)
        async for line in _error_tail(exc):
            yield line
    else:
        if request.include_usage and final is not None:
            usage = usage_of([final])
            yield sse(
                ChatCompletionChunk(
                    id=request_id, model=ctx.served_model_name, choices=[], usage=usage
                )
            )
    yield DONE_LINE
