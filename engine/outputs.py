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

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """State of one request after an engine step.

    ``token_ids``/``text`` hold everything generated so far (stop strings excluded from
    ``text``); ``new_token_ids``/``new_text`` only what this step added (for streaming).
    ``num_cached_tokens`` is the prompt prefix served from cache (GPU prefix hit plus, with
    ``--kv-offload``, tokens loaded from lower tiers).
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
    metrics: RequestMetrics | None = None
