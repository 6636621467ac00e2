"""What ``LLMEngine`` keeps per request between its steps, and what it makes of it.

``RequestState`` is a live request's engine-side record: the scheduler's ``Request``, its
detokenizer (None when the caller detokenizes), its metrics and logprobs so far. From it come
the ``RequestOutput`` each step returns (``request_output``: a snapshot, never a live view) and,
once the request ends, its request-log line (``log_entry``). ``cached_tokens_by_tier`` splits a
request's cached prompt tokens by the tier that served them. Torch-free; the engine thread only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.outputs import RequestMetrics, RequestOutput, TokenLogprob
from engine.request import Request
from engine.request_log import RequestLogEntry
from engine.tokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class RequestState:
    request: Request
    detokenizer: IncrementalDetokenizer | None  # None: token ids only (detokenize=False)
    metrics: RequestMetrics
    arrival_unix_s: float
    logprobs: list[TokenLogprob] | None = None  # one per output token, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token
    # cached_tokens_by_tier, kept while (num_cached_tokens and the two tier lists' lengths)
    # stay the same
    by_tier: tuple[tuple[int, int, int], dict[str, int]] | None = None


def cached_tokens_by_tier(request: Request, block_size: int, offload: bool) -> dict[str, int]:
    """``request.num_cached_tokens`` split by the tier that served each cached block: the
    offload connector records one tier per block (``kv_hit_tiers``, then an overlap's loaded
    tail, ``kv_tail_tiers``); without it every hit is a GPU prefix hit. Blocks are counted in order up to the cached total, so a load cut short
    (or the last prompt token, always recomputed) is not counted."""
    remaining = max(request.num_cached_tokens, 0)
    if offload:
        tiers = [*request.kv_hit_tiers, *request.kv_tail_tiers]
    else:
        tiers = ["gpu"] * -(-remaining // block_size)
    split: dict[str, int] = {}
    for tier in tiers:
        if remaining <= 0:
            break
        n = min(block_size, remaining)
        split[tier] = split.get(tier, 0) + n
        remaining -= n
    if remaining > 0:  # tiers not recorded (should not happen): still count the tokens
        split["gpu"] = split.get("gpu", 0) + remaining
    return split


def request_output(
    state: RequestState,
    new_ids: list[int],
    new_text: str,
    *,
    finished: bool,
    block_size: int,
    offload: bool,
    new_logprobs: list[TokenLogprob] | None = None,
) -> RequestOutput:
    """The request's output now (``offload``: a KV connector records the tier of each hit)."""
    request = state.request
    return RequestOutput(
        req_id=request.req_id,
        prompt_token_ids=request.prompt_token_ids,
        token_ids=list(request.output_token_ids),
        text=state.detokenizer.text if state.detokenizer is not None else "",
        new_token_ids=new_ids,
        new_text=new_text,
        finished=finished,
        finish_reason=request.status.finish_reason,
        stop_reason=request.stop_reason,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        num_cached_tokens_by_tier=_by_tier(state, block_size, offload),
        logprobs=None if state.logprobs is None else list(state.logprobs),
        new_logprobs=new_logprobs if state.logprobs is not None else None,
        prompt_logprobs=state.prompt_logprobs,
        metrics=dataclasses.replace(state.metrics),  # a snapshot, not a live view
    )


def _by_tier(state: RequestState, block_size: int, offload: bool) -> dict[str, int]:
    request = state.request
    key = (request.num_cached_tokens, len(request.kv_hit_tiers), len(request.kv_tail_tiers))
    if state.by_tier is None or state.by_tier[0] != key:
        state.by_tier = (key, cached_tokens_by_tier(request, block_size, offload))
    return state.by_tier[1]


def log_entry(state: RequestState, block_size: int, offload: bool) -> RequestLogEntry:
    """The request log's line for a request that ended (``engine/request_log.py``)."""
    request, m = state.request, state.metrics
    bs = block_size
    hit_tiers = request.kv_hit_tiers
    if not offload:
        hit_tiers = ["gpu"] * (max(request.num_cached_tokens, 0) // bs)
    ttft = None if m.first_token_time is None else m.first_token_time - m.arrival_time
    return RequestLogEntry(
        ts=state.arrival_unix_s,
        req_id=request.req_id,
        prompt_tokens=request.num_prompt_tokens,
        block_hashes=tuple(
            h.hex() for h in request.block_hashes[: request.num_prompt_tokens // bs]
        ),
        hit_tiers=tuple(hit_tiers),
        decision=request.kv_decision,
        ttft_s=ttft,
        ttft_breakdown_s=m.ttft_breakdown,
        num_prefill_steps=request.times.num_prefill_steps,
        prefill_step_tokens=request.times.prefill_step_tokens,
        kv_plan=request.kv_plan,
        load_read_s=request.times.load_read_s,
        load_copy_s=request.times.load_copy_s,
        prefill_step_parts_s=dict(request.times.prefill_step_parts_s),
    )


def collect_prompt_logprobs(
    states: dict[str, RequestState], chunks: dict[str, tuple[int, list[object]]]
) -> None:
    """Places each chunk's prompt logprobs at its positions (a re-prefill after a
    preemption overwrites them with the same values)."""
    for req_id, (first, entries) in chunks.items():
        state = states.get(req_id)
        if state is None or state.prompt_logprobs is None:
            continue
        del state.prompt_logprobs[first:]
        state.prompt_logprobs.extend(entries)  # type: ignore[arg-type]
