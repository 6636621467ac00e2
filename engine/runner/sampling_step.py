"""The sampling end of a step: from the rows of hidden states that sample to the step's tokens
and logprobs, written into its ``ModelRunnerOutput``.

``sample_tokens``: token masks (``allowed_token_ids``, ``min_tokens``), penalties, grammar
masks, sampling (the step's one host sync), then the logprobs of the raw logits for the
requests that asked. ``prompt_logprobs``: the logprobs of the prompt tokens this step's chunks
predict. Both run under the runner's inference mode, on rank 0 only under tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core_types import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.runner.logits_processors import (
    MaskRow,
    PenaltyRow,
    apply_penalties,
    mask_tokens,
    token_logprobs,
)
from engine.runner.sampler import Sampler, SampleRequest
from engine.runner.structured_output import RequestGrammars


def sample_tokens(
    logits: torch.Tensor,
    sliced: list[ScheduledRequest],
    result: ModelRunnerOutput,
    sampler: Sampler,
    grammars: Callable[[], RequestGrammars],
    before_sync: Callable[[], None] | None = None,
) -> None:
    """Token masks, penalties (vLLM's order), grammar masks, sampling, then logprobs of the
    raw ``logits``; fills ``result``. The one host sync of a plain step is the sampled ids'
    copy. ``grammars``: the runner's grammar state, built on the first constrained request;
    ``before_sync``: called once the sampling is queued, before that copy (the connector's
    ``forward_queued``)."""
    processed = mask_tokens(
        logits,
        [
            MaskRow(s.sampling.allowed_token_ids, s.min_tokens_stop_ids)
            if s.sampling.allowed_token_ids is not None or s.min_tokens_stop_ids
            else None
            for s in sliced
        ],
    )
    processed = apply_penalties(
        processed,
        [
            PenaltyRow(s.sampling, s.all_token_ids, s.num_output_tokens)
            if s.sampling.has_penalties
            else None
            for s in sliced
        ],
    )
    grammar_rows = [
        (s.req_id, s.sampling, s.all_token_ids[len(s.all_token_ids) - s.num_output_tokens :])
        if s.sampling.has_grammar
        else None
        for s in sliced
    ]
    state = grammars() if any(r is not None for r in grammar_rows) else None
    if state is not None:
        processed = state.mask(processed, grammar_rows)
    requests = [SampleRequest(s.sampling, s.num_output_tokens) for s in sliced]
    sampled = sampler.sample(processed, requests)
    if before_sync is not None:
        before_sync()
    tokens = sampled.tolist()  # the step's one sync
    result.sampled_token_ids = {s.req_id: t for s, t in zip(sliced, tokens, strict=True)}
    if state is not None:
        for s, token in zip(sliced, tokens, strict=True):
            if s.sampling.has_grammar:
                state.accept(s.req_id, token)
    wanted = [i for i, s in enumerate(sliced) if s.sampling.logprobs is not None]
    if wanted:
        index = torch.tensor(wanted, dtype=torch.int64, device=logits.device)
        entries = token_logprobs(
            logits.index_select(0, index),
            [tokens[i] for i in wanted],
            [sliced[i].sampling.logprobs or 0 for i in wanted],
        )
        result.logprobs = {sliced[i].req_id: e for i, e in zip(wanted, entries, strict=True)}


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    out: SchedulerOutput,
    result: ModelRunnerOutput,
) -> None:
    """Logprobs of the prompt tokens this step's chunks predict: the row of position
    ``p`` gives token ``p + 1``'s. Such requests bypass the prefix cache (scheduler), so
    every prompt position passes through here once (again after a preemption)."""
    offset = 0
    for r in out.requests:
        k = r.sampling.prompt_logprobs
        start, n = r.num_computed_tokens, len(r.token_ids)
        end = min(start + n, r.num_prompt_tokens - 1)  # the last prompt row samples
        if k is not None and start < end:
            rows = hidden[offset : offset + end - start]
            entries = token_logprobs(
                compute_logits(rows),
                r.all_token_ids[start + 1 : end + 1],
                [k] * (end - start),
            )
            result.prompt_logprobs[r.req_id] = (start + 1, list(entries))
        offset += n
