"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's request and response shapes.

``/tokenize`` takes ``{"model"?, "prompt", "add_special_tokens"? (default true)}`` or
``{"model"?, "messages", "add_generation_prompt"? (true), "continue_final_message"? (false),
"add_special_tokens"? (false)}`` (the chat template, ``--chat-template`` or the tokenizer's, is
applied as ``/v1/chat/completions`` applies it) and answers ``{"count", "max_model_len",
"tokens", "token_strs"}`` (``token_strs`` with ``return_token_strs: true``, else null).
``/detokenize`` takes ``{"model"?, "tokens"}`` and answers ``{"prompt"}`` (special tokens
kept, so that a tokenized prompt comes back as it went in).

A text is tokenized only up to the model's context (``engine.tokenizer.encode_within``): a
longer one is a 400, as for completions, since tokenizing runs on the event loop.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError

from engine.server.protocol import (
    TOKEN_ID_LIMIT,
    ChatMessage,
    ChatTemplateOptions,
    ProtocolError,
    _Request,
)
from engine.server.serving import ServingContext
from engine.tokenizer import TooManyTokens, encode_within, render_chat


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False

    def texts(self) -> Iterator[tuple[str, str]]:
        yield from super().texts()
        yield "prompt", self.prompt


class TokenizeChatRequest(ChatTemplateOptions):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_special_tokens: bool = False
    return_token_strs: bool = False

    def texts(self) -> Iterator[tuple[str, str]]:
        yield from super().texts()
        for i, m in enumerate(self.messages):
            yield f"messages.{i}.role", m.role
            yield f"messages.{i}.content", m.text()


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]]


class DetokenizeResponse(BaseModel):
    prompt: str


async def _parse(raw: Request, models: tuple[type[_Request], ...]) -> _Request:
    """The body as the first of ``models`` whose required fields it names (``messages`` picks
    the chat form); a malformed body is a 400 as FastAPI's own validation gives."""
    try:
        data: Any = json.loads(await raw.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"body: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ProtocolError("body: expected a JSON object")
    model = models[-1] if "messages" in data and len(models) > 1 else models[0]
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors()]
        ) from None
    request.check_text()
    return request


def _chat_text(ctx: ServingContext, request: TokenizeChatRequest) -> str:
    request.check_template_options()
    for i, m in enumerate(request.messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if part.type != "text":
                raise ProtocolError(
                    f"messages.{i}.content.{j}: content parts of type "
                    f"{part.type!r} are not supported (text only)",
                    f"messages.{i}.content.{j}",
                )
    conversation = [{"role": m.role, "content": m.text()} for m in request.messages]
    try:
        return render_chat(
            ctx.engine.tokenizer,
            conversation,
            ctx.chat_tokens.chat_template,
            **request.template_options(),
        )
    except ValueError as exc:
        raise ProtocolError(f"cannot apply the chat template: {exc}", "messages") from exc


async def tokenize(ctx: ServingContext, raw: Request) -> TokenizeResponse:
    """Raises ProtocolError / RequestValidationError (400) or APIError (404, unknown model)."""
    request = await _parse(raw, (TokenizeCompletionRequest, TokenizeChatRequest))
    ctx.check_model(request)  # type: ignore[arg-type]
    if isinstance(request, TokenizeChatRequest):
        text, param = _chat_text(ctx, request), "messages"
    else:
        assert isinstance(request, TokenizeCompletionRequest)
        text, param = request.prompt, "prompt"
    tokenizer = ctx.engine.tokenizer
    max_len = ctx.engine.max_model_len
    try:
        ids = await ctx.run_tokenizer(
            encode_within,
            tokenizer,
            text,
            max_len,
            request.add_special_tokens,  # type: ignore[attr-defined]
        )
    except TooManyTokens as exc:
        raise ctx.too_long(exc.at_least, param) from None
    if len(ids) > max_len:
        raise ProtocolError(
            f"the text is {len(ids)} tokens long, over this model's maximum "
            f"context length of {max_len} tokens",
            param,
        )
    strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None  # type: ignore[attr-defined]
    return TokenizeResponse(count=len(ids), max_model_len=max_len, tokens=ids, token_strs=strs)


async def detokenize(ctx: ServingContext, raw: Request) -> DetokenizeResponse:
    """Raises ProtocolError (400: an id outside the vocabulary) or APIError (404)."""
    request = await _parse(raw, (DetokenizeRequest,))
    assert isinstance(request, DetokenizeRequest)
    ctx.check_model(request)  # type: ignore[arg-type]
    tokenizer = ctx.engine.tokenizer
    vocab = len(tokenizer)
    bad = next((i for i, t in enumerate(request.tokens) if t >= vocab), None)
    if bad is not None:
        raise ProtocolError(
            f"tokens.{bad}: token id {request.tokens[bad]} is outside the "
            f"vocabulary (size {vocab})",
            f"tokens.{bad}",
        )
    text = tokenizer.decode(
        request.tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    return DetokenizeResponse(prompt=text)
