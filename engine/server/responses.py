"""OpenAI-compatible response models (pydantic): completions, chat completions (whole and
streamed chunks), usage, logprobs, the model list and the error body. Field names follow the
OpenAI API; ``PromptTokensDetails.kvtier_cached_tokens_by_tier`` is a kvtier extension. The
request models are ``engine.server.protocol``'s."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens whose KV was reused (GPU prefix-cache hits plus tokens
    loaded from lower tiers). ``kvtier_cached_tokens_by_tier``: the same tokens by the tier
    that served them ("gpu", "host", "lmdb", "redis", "s3", ...), a kvtier extension."""

    cached_tokens: int = 0
    kvtier_cached_tokens_by_tier: dict[str, int] = Field(default_factory=dict)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The completions API's (legacy) logprobs: parallel lists, one entry per token; the
    first prompt token of an ``echo`` has None (nothing predicts it)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it
    logprobs: CompletionLogprobs | None = None


class _Response(BaseModel):
    """The head of every completion response and stream chunk, in the OpenAI API's field
    order; each subclass fixes ``object`` (an overridden field keeps its place)."""

    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """A stream chunk's delta. A field that is None is left out of the JSON, as OpenAI and
    vLLM send it: ``role`` only in the first chunk, ``content`` (a string, ``""`` at
    least) in every other, so that a client's ``text += delta.content`` never meets null."""

    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "kvtier"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
