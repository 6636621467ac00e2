"""API-side request state: turns the core's token ids into ``RequestOutput``s with text.

The core process sends token ids only. Here each request keeps its own
``IncrementalDetokenizer`` and applies exactly what ``LLMEngine`` does per token (a stop token
or EOS is not decoded; a stop string cuts the text and ends the request; the held-back tail is
flushed on any other finish), so outputs equal ``LLM.generate``'s. Stop strings are handled
only here: the core never sees them, and the caller aborts the request in the core when
``ProcessedOutput.abort_in_core`` is set. Not thread-safe (one per request, used by the
client's output thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from engine.core.messages import CoreOutput
from engine.outputs import RequestMetrics, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer


def core_params(params: SamplingParams) -> SamplingParams:
    """``params`` as the core receives them: without stop strings (the API process owns them)."""
    return replace(params, stop=()) if params.stop else params


@dataclass(frozen=True, slots=True)
class ProcessedOutput:
    output: RequestOutput
    # A stop string ended the request here while the core still runs it: abort it there.
    abort_in_core: bool


@dataclass(slots=True)
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_by_tier: dict[str, int] = field(default_factory=dict)

    @classmethod
    def new(
        cls,
        tokenizer: Any,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> RequestState:
        detok = IncrementalDetokenizer.for_params(tokenizer, prompt_token_ids, params)
        return cls(
            req_id,
            prompt_token_ids,
            detok,
            RequestMetrics(arrival_time=arrival_time),
            logprobs=[] if params.logprobs is not None else None,
        )

    def process(self, core: CoreOutput) -> ProcessedOutput:
        """Mutates this state with one step's output. Tokens after a stop string (the core
        may run ahead of the abort) never reach here: the caller drops the state once an
        output is finished."""
        finished, reason, stop_reason = core.finished, core.finish_reason, core.stop_reason
        new_ids: list[int] = []
        new_text = ""
        abort_in_core = False
        if core.num_cached_tokens_by_tier is not None:
            self.cached_by_tier = dict(core.num_cached_tokens_by_tier)
        if core.prompt_logprobs is not None:
            self.prompt_logprobs = [
                None if e is None else TokenLogprob.from_plain(e) for e in core.prompt_logprobs
            ]
        core_logprobs = [TokenLogprob.from_plain(e) for e in core.new_logprobs or ()]
        new_logprobs: list[TokenLogprob] | None = None if self.logprobs is None else []
        for i, token_id in enumerate(core.new_token_ids):
            last = i == len(core.new_token_ids) - 1
            new_ids.append(token_id)
            self.token_ids.append(token_id)
            if new_logprobs is not None and i < len(core_logprobs):
                new_logprobs.append(core_logprobs[i])
            # Only the final token of a finished request can be a stop token or EOS; like the
            # engine, it ends the request without becoming text.
            stopped_by_token = last and finished and reason == "stop"
            update = self.detokenizer.update([token_id], decode=not stopped_by_token)
            new_text += update.new_text
            if update.stop_string is not None:
                abort_in_core = not (last and finished)
                finished, reason, stop_reason = True, "stop", update.stop_string
                break
            if last and finished:
                new_text += self.detokenizer.flush()
        self._update_metrics(core, finished)
        if self.logprobs is not None and new_logprobs:
            self.logprobs.extend(new_logprobs)
        output = RequestOutput(
            req_id=self.req_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.token_ids),
            text=self.detokenizer.text,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=reason if finished else None,
            stop_reason=stop_reason if finished else None,
            num_cached_tokens=core.num_cached_tokens,
            num_cached_tokens_by_tier=self.cached_by_tier,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            new_logprobs=new_logprobs,
            prompt_logprobs=self.prompt_logprobs,
            metrics=replace(self.metrics),  # a snapshot, not a live view
        )
        return ProcessedOutput(output, abort_in_core)

    def _update_metrics(self, core: CoreOutput, finished: bool) -> None:
        m = self.metrics
        if m.first_token_time is None:
            m.first_token_time = core.first_token_time
        if core.ttft_breakdown is not None:
            m.ttft_breakdown = core.ttft_breakdown
        if core.scheduled_time is not None:
            m.queued_time, m.scheduled_time = core.queued_time, core.scheduled_time
        m.last_token_time = core.last_token_time or m.last_token_time
        if finished:
            m.finished_time = core.finished_time or core.last_token_time
