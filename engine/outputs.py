"""What the engine hands back to callers (offline ``LLM`` and the HTTP server)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float  # time.monotonic() at add_request
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Phase -> seconds (engine/ttft.py), set with the first token.
    ttft_breakdown: dict[str, float] | None = None
    # The core's stamps, set with the first token (vLLM's QUEUED and SCHEDULED events): the
    # request reached the core's waiting queue; it could first compute (admitted, its KV
    # load, if one was asynchronous, done).
    queued_time: float | None = None
    scheduled_time: float | None = None

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-probability under the model's raw distribution, and the ``top`` k
    (token id, log-probability) pairs of that position, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_plain(self) -> list[object]:
        """As msgpack carries it: ``[token_id, logprob, [[id, logprob], ...]]``."""
        return [self.token_id, self.logprob, [list(t) for t in self.top]]

    @classmethod
    def from_plain(cls, value: list[object]) -> TokenLogprob:
        token_id, logprob, top = value
        return cls(
            int(token_id),
            float(logprob),  # type: ignore[arg-type]
            tuple((int(i), float(lp)) for i, lp in top),
        )  # type: ignore[union-attr]


@dataclass(slots=True)
class RequestOutput:
    """State of one request after an engine step.

    ``token_ids``/``text`` hold everything generated so far (stop strings excluded from
    ``text``); ``new_token_ids``/``new_text`` only what this step added (for streaming).
    ``num_cached_tokens`` is the prompt prefix served from cache (GPU prefix hit plus, with
    ``--kv-offload``, tokens loaded from lower tiers); ``num_cached_tokens_by_tier`` splits it
    by the tier that served each block ("gpu", "host", "lmdb", ...).
    ``logprobs`` (cumulative) / ``new_logprobs`` (this step) hold one entry per generated token
    when ``SamplingParams.logprobs`` is set; ``prompt_logprobs`` one per prompt token (None for
    the first) when ``SamplingParams.prompt_logprobs`` is set, complete from the first output on.
    """

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or token that ended it
    num_cached_tokens: int = 0
    num_cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    metrics: RequestMetrics | None = None

    @property
    def carries_first_token(self) -> bool:
        """This output brings the request's first generated token (and any others of the same
        step)."""
        return len(self.token_ids) == len(self.new_token_ids) > 0
