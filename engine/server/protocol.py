"""OpenAI-compatible request models (pydantic) and the request -> SamplingParams mapping
(the response models are ``engine.server.responses``'s). Field names follow the OpenAI API; ``top_k``, ``min_tokens``, ``ignore_eos``,
``repetition_penalty`` and ``stop_token_ids`` are vLLM-style extensions. Unknown fields are
ignored, as OpenAI clients send fields this server does not implement, except the fields that
change what a response means (``tools``, ``logit_bias``, ``suffix``, vLLM's ``guided_json``,
``use_beam_search``, ...): those are declared and refused with a 400 naming the field rather
than silently dropped (served at their neutral values)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from engine.grammar import check_grammar
from engine.sampling_params import MAX_LOGPROBS, SamplingParams


class ProtocolError(ValueError):
    """A request the server rejects with 400 (``param`` names the offending field)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# Integers a request may carry: what the engine's wire (msgpack) and sampler take; a larger
# value is a 400 naming the field, not a 500 when it is packed (``seed: 2**200``).
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TOKEN_ID_LIMIT = 2**31  # block hashes pack token ids as int32


def invalid_unicode(text: str) -> int | None:
    """Where ``text`` stops being valid Unicode (a lone surrogate, which JSON allows as an
    escape and no tokenizer takes), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


class _Request(BaseModel):
    # Strict types, as OpenAI's API: "max_tokens": "5", 5.0 or true is a 400 naming the field,
    # not a 5 (an int is still a valid float).
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """An explicit null on a field whose default is not null (``"n": null``, ``"stream":
        null``) means that default, as vLLM and OpenAI's clients read optional fields."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in fields or fields[k].default is None
        }

    def texts(self) -> Iterator[tuple[str, str]]:
        """Every free-text field value with its name (``check_text``)."""
        for name in ("model", "user", "suffix"):
            value = getattr(self, name, None)
            if isinstance(value, str):
                yield name, value
        stop = getattr(self, "stop", None)
        for i, s in enumerate([stop] if isinstance(stop, str) else stop or []):
            yield ("stop" if isinstance(stop, str) else f"stop.{i}"), s

    def check_text(self) -> None:
        """Raises ProtocolError naming the field for a string that is not valid Unicode.
        First of all checks: an error message may quote a field (the model name)."""
        for name, value in self.texts():
            at = invalid_unicode(value)
            if at is not None:
                raise ProtocolError(
                    f"{name}: invalid Unicode (a lone surrogate at character {at})", name
                )


class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk also carries its choice's usage so far
    continuous_usage_stats: bool = False


# vLLM's request extensions that change what a response means, which kvtier does not
# implement: (field, why it is refused). Each is a 400 naming it unless absent or at its
# neutral value (``_NEUTRAL``), never dropped: a client asking for a regex-constrained answer
# must not get free text that looks like a success.
_VLLM_REFUSED = (
    ("guided_json", "use response_format {'type': 'json_schema', ...} instead"),
    ("guided_choice", "no choice-constrained decoding"),
    ("guided_regex", "no regex-constrained decoding"),
    ("guided_grammar", "no grammar-constrained decoding"),
    ("structured_outputs", "use response_format 'json_schema' or 'json_object' instead"),
    ("use_beam_search", "no beam search"),
    ("bad_words", "no banned-word lists"),
    (
        "cache_salt",
        "no per-request cache salt: every request of this server shares its prefix cache",
    ),
    ("prompt_logprobs", "use /v1/completions with echo: true and logprobs: k instead"),
)
_NEUTRAL: dict[str, Any] = {"use_beam_search": False, "bad_words": []}


MAX_N = 128  # OpenAI's bound on ``n``
MAX_REQUEST_ID = 256  # characters of a client's request id (header or body)


class SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    # vLLM's: the response's id is "cmpl-" / "chatcmpl-" + this (the X-Request-Id header wins)
    request_id: Annotated[str, Field(max_length=MAX_REQUEST_ID)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None  # vLLM's: drop tokens below min_p x the top token's probability
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]] | None = None
    n: Int64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    include_stop_str_in_output: bool = False  # vLLM's extension: the stop string ends the text
    skip_special_tokens: bool = True  # vLLM's: special tokens left out of the text
    # vLLM's: only these ids may be sampled
    allowed_token_ids: list[Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: as many as the context leaves room for)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    bad_words: list[str] | None = None  # declared to be refused
    cache_salt: str | None = None  # declared to be refused
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension (HF's definition)
    # vLLM's extension: logprob tokens as "token_id:N" rather than their decoded text.
    return_tokens_as_token_ids: bool = False
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # Declared to be refused (check_supported): ignoring them would answer another question.
    logit_bias: dict[str, Any] | None = None
    best_of: Int64 | None = None
    guided_json: Any = None
    guided_choice: Any = None
    guided_regex: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    use_beam_search: bool = False
    prompt_logprobs: Int64 | None = None
    _grammar: tuple[str | None, bool] | None = PrivateAttr(default=None)

    def requested_max_tokens(self) -> int | None:
        raise NotImplementedError

    def logprob_settings(self) -> tuple[int | None, int | None]:
        """(top-k per sampled token or None, top-k per prompt token or None)."""
        return None, None

    def check_supported(self) -> None:
        """Raises ProtocolError for valid-but-unsupported options (and ``n`` out of range)."""
        if not 1 <= self.n <= MAX_N:
            raise ProtocolError(f"n must be in [1, {MAX_N}], got n={self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("stream_options requires stream=true", "stream_options")
        if self.truncate_prompt_tokens == 0:
            raise ProtocolError(
                "truncate_prompt_tokens must be -1 (all that fit) or >= 1", "truncate_prompt_tokens"
            )
        for name, why in _VLLM_REFUSED:
            value = getattr(self, name)
            if value is not None and value != _NEUTRAL.get(name):
                raise ProtocolError(f"{name} is not supported ({why})", name)
        self.grammar()  # raises for an unsupported or invalid response_format
        if self.logit_bias:
            raise ProtocolError("logit_bias is not supported", "logit_bias")
        if self.best_of not in (None, self.n):
            raise ProtocolError(
                f"best_of must equal n (no server-side ranking of samples), "
                f"got best_of={self.best_of}, n={self.n}",
                "best_of",
            )

    def grammar(self) -> tuple[str | None, bool]:
        """``response_format`` as (JSON schema text or None, json_object). Raises
        ProtocolError (400) for an unknown type, a malformed or invalid schema, or when the
        grammar library (xgrammar) is not installed. Checked once per request."""
        if self._grammar is None:
            self._grammar = self._check_grammar()
        return self._grammar

    def _check_grammar(self) -> tuple[str | None, bool]:
        fmt = self.response_format
        kind = "text" if fmt is None else fmt.get("type", "text")
        if kind == "text":
            return None, False
        if kind == "json_object":
            schema = None
        elif kind == "json_schema":
            spec = fmt.get("json_schema") if fmt else None
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ProtocolError(
                    "response_format json_schema needs "
                    "{'json_schema': {'name': ..., 'schema': {...}}}",
                    "response_format",
                )
            schema = json.dumps(spec.get("schema", {}))
        else:
            raise ProtocolError(
                f"response_format {kind!r} is not supported; use 'text', "
                "'json_object' or 'json_schema'",
                "response_format",
            )
        try:
            check_grammar(schema, schema is None)
        except ImportError as exc:
            raise ProtocolError(
                f"response_format {kind!r} is not available on this server: {exc}",
                "response_format",
            ) from None
        except ValueError as exc:
            raise ProtocolError(f"response_format: {exc}", "response_format") from None
        return schema, schema is None

    def to_sampling_params(self, max_tokens: int, sample_index: int = 0) -> SamplingParams:
        """``max_tokens`` is the resolved budget (the server fills a default);
        ``sample_index``: which of the ``n`` samples (a seeded request's sample ``i`` uses
        ``seed + i``, so the n samples differ and the same seed gives the same n). Raises
        ProtocolError naming the field when SamplingParams rejects a value."""
        stop: tuple[str, ...] = (
            (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        )
        logprobs, prompt_logprobs = self.logprob_settings()
        schema, json_object = self.grammar()
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                allowed_token_ids=(
                    None if self.allowed_token_ids is None else tuple(self.allowed_token_ids)
                ),
                skip_special_tokens=self.skip_special_tokens,
                seed=None if self.seed is None else self.seed + sample_index,
                stop=stop,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if self.repetition_penalty is None else self.repetition_penalty
                ),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                json_schema=schema,
                json_object=json_object,
            )
        except ValueError as exc:
            message = str(exc)
            param = message.split(" ", 1)[0] if message else None
            raise ProtocolError(message, param) from exc

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats`` (only with ``include_usage``, as there)."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Int64 | None = 16
    echo: bool = False
    # Top-k per token (the sampled token always comes too).
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None

    def logprob_settings(self) -> tuple[int | None, int | None]:
        # echo + logprobs: the prompt tokens' logprobs come first (lm-eval's loglikelihood).
        return self.logprobs, self.logprobs if self.echo else None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts (strings or token-id lists)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ProtocolError("prompt must not be empty", "prompt")
        prompts: list[str | list[int]] = (
            [list(p)] if all(isinstance(x, int) for x in p) else list(p)  # type: ignore[arg-type]
        )
        for ids in prompts:
            if not isinstance(ids, str) and not all(0 <= t < TOKEN_ID_LIMIT for t in ids):
                raise ProtocolError(f"prompt: token ids must be in [0, {TOKEN_ID_LIMIT})", "prompt")
        return prompts

    def texts(self) -> Iterator[tuple[str, str]]:
        yield from super().texts()
        p = self.prompt
        for i, s in enumerate([p] if isinstance(p, str) else p):
            if isinstance(s, str):
                yield ("prompt" if isinstance(p, str) else f"prompt.{i}"), s

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise ProtocolError("suffix is not supported", "suffix")


class ContentPart(_Request):
    """One part of a message's content. Only ``text`` parts are served; any other type
    (``image_url``, ``input_audio``, ...) is parsed so that it can be refused by name."""

    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content if part.type == "text")


class ChatTemplateOptions(_Request):
    """vLLM's chat-template switches, shared by chat completions and ``/tokenize``:
    ``continue_final_message`` leaves the last message open (an assistant prefill the model
    continues), ``chat_template_kwargs`` are more template variables (e.g. enable_thinking).
    A per-request ``chat_template`` is refused."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None

    def check_template_options(self) -> None:
        """Raises ProtocolError naming the field for options that cannot be rendered."""
        if self.continue_final_message and self.add_generation_prompt:
            raise ProtocolError(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        if self.chat_template is not None:
            raise ProtocolError(
                "chat_template: a per-request template is not supported; start the server "
                "with --chat-template",
                "chat_template",
            )

    def template_options(self) -> dict[str, Any]:
        """``render_chat``'s options that differ from its defaults (empty: the default
        rendering, which the chat token cache serves)."""
        options: dict[str, Any] = {}
        if not self.add_generation_prompt:
            options["add_generation_prompt"] = False
        if self.continue_final_message:
            options["continue_final_message"] = True
        if self.chat_template_kwargs:
            options["template_kwargs"] = dict(self.chat_template_kwargs)
        return options


class ChatCompletionRequest(SamplingRequest, ChatTemplateOptions):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    def logprob_settings(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs requires logprobs=true", "top_logprobs")
        # tools with tool_choice "none" (functions with function_call "none") cannot be
        # called: the answer is the one without them, so they are ignored, not refused.
        for name, choice in (("tools", "tool_choice"), ("functions", "function_call")):
            if getattr(self, name) and getattr(self, choice) != "none":
                raise ProtocolError(f"{name} (tool calling) is not supported", name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise ProtocolError(f"{name} is not supported (no tool calling)", name)
        self.check_template_options()
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list):
                for j, part in enumerate(m.content):
                    if part.type != "text":
                        raise ProtocolError(
                            f"messages.{i}.content.{j}: content parts of type "
                            f"{part.type!r} are not supported (text only)",
                            f"messages.{i}.content.{j}",
                        )
                    if part.text is None:
                        raise ProtocolError(
                            f"messages.{i}.content.{j}: a text part needs 'text'",
                            f"messages.{i}.content.{j}",
                        )

    def texts(self) -> Iterator[tuple[str, str]]:
        yield from super().texts()
        for i, m in enumerate(self.messages):
            yield f"messages.{i}.role", m.role
            yield f"messages.{i}.content", m.text()

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens supersedes the deprecated max_tokens in OpenAI's API.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
