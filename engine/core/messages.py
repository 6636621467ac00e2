"""The wire format between the API process and the engine-core process: msgpack, never pickle.

Every message is a msgpack array ``[tag, field, ...]`` with fields in dataclass order. Requests
flow API -> core on one PUSH/PULL pair (``CoreRequest``); events flow core -> API on another
(``CoreEvent``), one ``StepOutputs`` per engine step carrying every request it touched. Token
ids only cross: the API process tokenizes and detokenizes. Torch-free; ``decode_*`` raise
ValueError on a malformed message.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgpack

from engine.sampling_params import SamplingParams

_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


# --- API -> core ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic(): one clock for every process of the host
    # The API's own TTFT phases (engine/ttft.py API_PHASES), for the request log.
    api_times: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AbortRequests:
    req_ids: list[str]


@dataclass(frozen=True, slots=True)
class StatsRequest:
    """Asks the core to push a ``StepOutputs`` with no outputs and its current stats."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The core finishes its current step, closes its sockets and exits with code 0."""


CoreRequest = AddRequest | AbortRequests | StatsRequest | Shutdown

# --- core -> API ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CoreOutput:
    """What one step did to one request. ``stop_reason`` is a stop token id or None (stop
    strings are the API process's business); times are ``time.monotonic()`` in the core."""

    req_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    # Phase -> seconds (engine/ttft.py), on the output carrying the first token only.
    ttft_breakdown: dict[str, float] | None = None
    # On the first token's output only: the cached tokens by serving tier, and the prompt
    # logprobs (``TokenLogprob.to_plain`` lists, None for the first prompt token) if asked.
    num_cached_tokens_by_tier: dict[str, int] | None = None
    prompt_logprobs: list[Any] | None = None
    # This output's tokens' logprobs (``TokenLogprob.to_plain`` lists) if asked.
    new_logprobs: list[Any] | None = None
    # On the first token's output only: ``RequestMetrics.queued_time`` / ``scheduled_time``.
    queued_time: float | None = None
    scheduled_time: float | None = None


@dataclass(frozen=True, slots=True)
class Ready:
    """Handshake: the model is loaded and the core is reading requests."""

    model_name: str
    max_model_len: int
    stats: dict[str, Any]
    pid: int


@dataclass(frozen=True, slots=True)
class StartupFailed:
    message: str


@dataclass(frozen=True, slots=True)
class RequestRejected:
    """``add_request`` raised ValueError: the request never entered the engine."""

    req_id: str
    message: str


@dataclass(frozen=True, slots=True)
class StepOutputs:
    outputs: list[CoreOutput]
    stats: dict[str, Any]  # the engine's stats() after this step


@dataclass(frozen=True, slots=True)
class CoreFailed:
    """A step raised: the core exits after sending this, and every request is lost."""

    message: str


CoreEvent = Ready | StartupFailed | RequestRejected | StepOutputs | CoreFailed

_OUTPUT_FIELDS = tuple(f.name for f in dataclasses.fields(CoreOutput))

_REQUEST_TAGS: dict[type, int] = {AddRequest: 1, AbortRequests: 2, StatsRequest: 3, Shutdown: 4}
_EVENT_TAGS: dict[type, int] = {
    Ready: 10, StartupFailed: 11, RequestRejected: 12, StepOutputs: 13, CoreFailed: 14
}  # fmt: skip
_REQUESTS_BY_TAG = {tag: cls for cls, tag in _REQUEST_TAGS.items()}
_EVENTS_BY_TAG = {tag: cls for cls, tag in _EVENT_TAGS.items()}


def to_plain(value: Any) -> Any:
    """``value`` reduced to what msgpack carries: numbers, strings, None, lists and str-keyed
    dicts of those. Anything else becomes None, so that a new stats key of an odd type can
    never break the channel."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return None


def encode_request(msg: CoreRequest) -> bytes:
    """Raises TypeError if ``params.extra`` holds something msgpack cannot carry."""
    if isinstance(msg, AddRequest):
        params = {name: getattr(msg.params, name) for name in _SAMPLING_FIELDS}
        fields: list[Any] = [
            msg.req_id,
            msg.prompt_token_ids,
            params,
            msg.arrival_time,
            msg.api_times,
        ]
    else:
        fields = [getattr(msg, f.name) for f in dataclasses.fields(msg)]
    return msgpack.packb([_REQUEST_TAGS[type(msg)], *fields], use_bin_type=True)


def decode_request(data: bytes) -> CoreRequest:
    tag, fields = _unpack(data)
    cls = _REQUESTS_BY_TAG.get(tag)
    if cls is None:
        raise ValueError(f"unknown core request tag {tag!r}")
    try:
        if cls is AddRequest:
            req_id, prompt_ids, params, arrival, api_times = fields
            if not isinstance(api_times, dict):
                raise TypeError("api_times is not a map")
            return AddRequest(
                req_id, list(prompt_ids), SamplingParams(**params), float(arrival), api_times
            )
        return cls(*fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed {cls.__name__}: {exc}") from exc


def encode_event(msg: CoreEvent) -> bytes:
    if isinstance(msg, StepOutputs):
        outputs = [[getattr(o, f) for f in _OUTPUT_FIELDS] for o in msg.outputs]
        fields: list[Any] = [outputs, to_plain(msg.stats)]
    elif isinstance(msg, Ready):
        fields = [msg.model_name, msg.max_model_len, to_plain(msg.stats), msg.pid]
    else:
        fields = [getattr(msg, f.name) for f in dataclasses.fields(msg)]
    return msgpack.packb([_EVENT_TAGS[type(msg)], *fields], use_bin_type=True)


def decode_event(data: bytes) -> CoreEvent:
    tag, fields = _unpack(data)
    cls = _EVENTS_BY_TAG.get(tag)
    if cls is None:
        raise ValueError(f"unknown core event tag {tag!r}")
    try:
        if cls is StepOutputs:
            outputs, stats = fields
            return StepOutputs([CoreOutput(*o) for o in outputs], stats)
        return cls(*fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed {cls.__name__}: {exc}") from exc


def _unpack(data: bytes) -> tuple[int, list[Any]]:
    try:
        msg = msgpack.unpackb(data, raw=False)
    except (msgpack.UnpackException, ValueError) as exc:
        raise ValueError(f"undecodable core message: {exc}") from exc
    if not isinstance(msg, list) or not msg or not isinstance(msg[0], int):
        raise ValueError(f"core message is not [tag, ...]: {type(msg).__name__}")
    return msg[0], msg[1:]
