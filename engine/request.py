"""Per-request scheduling state: tokens, progress, status. Torch-free.

A ``Request`` is owned and mutated by the scheduler (and, for its block hashes, the KV cache
manager). Not thread-safe.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from cachestore.hashing import BlockHash
from engine.sampling_params import SamplingParams
from engine.ttft import RequestTimes


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Admitted with blocks allocated while a connector loads its KV from a lower tier; other
    # requests keep running meanwhile (filled in by the offload connector).
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style finish reason: "stop" | "length" | "abort", None if unfinished."""
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
    }
)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    """One generation request.

    ``num_computed_tokens`` counts leading tokens of ``all_token_ids`` whose KV sits in the
    request's blocks. A preempted request keeps its outputs and recomputes from zero (minus any
    prefix hit). ``num_cached_tokens`` is the prompt prefix served from cache at first admission.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # -1 until first admitted
    num_preemptions: int = 0
    # Chained hashes of every full block of all_token_ids computed so far (kv_cache_manager).
    block_hashes: list[BlockHash] = field(default_factory=list)
    stop_reason: str | int | None = None
    # Set by the KV offload connector at admission, for the request log: the tier that served
    # each leading cached block ("gpu", "host", "lmdb", ...) and the reload decision.
    kv_hit_tiers: list[str] = field(default_factory=list)
    # The tier of each block an overlap loaded behind its computed head (not leading: the
    # request log's hit_tiers leave them out; the API's cached tokens by tier count them).
    kv_tail_tiers: list[str] = field(default_factory=list)
    kv_decision: str = "recompute"
    # The connector's planned split at admission (tokens from the GPU hit, computed as an
    # overlap's head, loaded, recomputed; the cost model's predicted TTFT), or None.
    kv_plan: dict[str, float] | None = None
    # Stamps for the TTFT breakdown (engine/ttft.py), until the first token.
    times: RequestTimes = field(default_factory=RequestTimes)
    # Tokens that decode alone to no text (``engine.tokenizer.textless_token_ids``); whether
    # an output outside them was sampled (``awaits_text``).
    textless_token_ids: frozenset[int] = frozenset()
    has_text: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.req_id!r}: empty prompt")
        if not self.all_token_ids:
            self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if not self.has_text and token_id not in self.textless_token_ids:
            self.has_text = True

    @property
    def awaits_text(self) -> bool:
        """It has sampled tokens, none of which decodes to text yet (``textless_token_ids``):
        its user has seen no first token."""
        return not self.has_text and bool(self.output_token_ids)

    def min_tokens_stop_ids(self) -> tuple[int, ...]:
        """The ids the next sample may not take: while fewer than ``min_tokens`` outputs
        exist, every ``stop_token_ids`` entry and EOS (vLLM's ``all_stop_token_ids``, which
        holds EOS even with ``ignore_eos``); else none. Sorted, so a step's mask is the same
        whatever the set order."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            return ()
        return tuple(sorted(self.eos_token_ids.union(params.stop_token_ids)))

    def check_token_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status implied by the last generated token, or None to continue.
        Token-level only: stop *strings* are the detokenizer's job (engine)."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens and self.output_token_ids:
            last = self.output_token_ids[-1]
            if last in params.stop_token_ids:
                self.stop_reason = last  # vLLM convention: EOS leaves stop_reason None
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
