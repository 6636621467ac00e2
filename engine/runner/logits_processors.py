"""What the model runner does to a step's logits besides sampling: token masks and penalties
(before the sampler) and log-probabilities (of the raw logits, for the response).

Token masks follow vLLM: ``allowed_token_ids`` leaves only those ids, and ``min_tokens``
(``MinTokensLogitsProcessor``) bans the stop ids and EOS until enough outputs exist; both set
logits to -inf before the penalties, so greedy rows obey them too.

Penalties follow Hugging Face's ``RepetitionPenaltyLogitsProcessor`` (over prompt and output
tokens) and OpenAI's definition of ``frequency_penalty`` / ``presence_penalty`` (over the
output tokens: ``logit -= frequency * count + presence * (count > 0)``), applied in vLLM's
order: repetition first. Only rows that ask for them pay anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class MaskRow:
    """One logits row to mask: the only ids it may sample (None: all) and the ids it may not
    (applied after ``allowed``, so a banned id stays banned even when allowed)."""

    allowed: Sequence[int] | None = None
    banned: Sequence[int] = ()


def mask_tokens(logits: torch.Tensor, rows: Sequence[MaskRow | None]) -> torch.Tensor:
    """``logits [n, vocab]`` with each non-None row's masked ids at -inf. Returns ``logits``
    itself when no row has a mask, else a float32 copy (the raw logits stay for logprobs).
    Ids must be inside the vocabulary (checked when the request is added)."""
    if all(r is None for r in rows):
        return logits
    out = logits.float().clone()
    allowed = [(i, r.allowed) for i, r in enumerate(rows) if r is not None and r.allowed]
    if allowed:
        keep = torch.zeros(len(allowed), out.shape[-1], dtype=torch.bool)
        for k, (_, ids) in enumerate(allowed):
            keep[k, list(ids)] = True
        # Non-blocking host-to-device copies: no sync before the step's one (the sampled ids).
        index = torch.tensor([i for i, _ in allowed], dtype=torch.int64)
        index = index.to(out.device, non_blocking=True)
        keep = keep.to(out.device, non_blocking=True)
        masked = out.index_select(0, index).masked_fill_(~keep, float("-inf"))
        out.index_copy_(0, index, masked)
    banned_rows = [i for i, r in enumerate(rows) if r is not None for _ in r.banned]
    if banned_rows:
        banned_ids = [t for r in rows if r is not None for t in r.banned]
        pairs = torch.tensor([banned_rows, banned_ids], dtype=torch.int64)
        pairs = pairs.to(out.device, non_blocking=True)
        out[pairs[0], pairs[1]] = float("-inf")
    return out


@dataclass(frozen=True, slots=True)
class PenaltyRow:
    """One logits row to penalize: its settings, the request's tokens so far and how many of
    them (the last ones) are output tokens."""

    params: SamplingParams
    token_ids: Sequence[int]
    num_output_tokens: int


def apply_penalties(logits: torch.Tensor, rows: Sequence[PenaltyRow | None]) -> torch.Tensor:
    """``logits [n, vocab]`` with each non-None row's penalties applied. Returns ``logits``
    itself when no row has any, else a float32 copy (the raw logits stay for logprobs)."""
    if not any(r is not None and r.params.has_penalties for r in rows):
        return logits
    out = logits.float().clone()
    vocab = out.shape[-1]
    for i, row in enumerate(rows):
        if row is None or not row.params.has_penalties:
            continue
        p = row.params
        ids = torch.tensor(list(row.token_ids), dtype=torch.int64, device=out.device)
        if p.repetition_penalty != 1.0 and ids.numel():
            seen = ids.unique()
            score = out[i, seen]
            out[i, seen] = torch.where(
                score < 0, score * p.repetition_penalty, score / p.repetition_penalty
            )
        if (p.frequency_penalty or p.presence_penalty) and row.num_output_tokens:
            outputs = ids[ids.numel() - row.num_output_tokens :]
            counts = torch.bincount(outputs, minlength=vocab)[:vocab].to(out.dtype)
            out[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
    return out


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprob]:
    """For each row ``i``: the log-probability of ``token_ids[i]`` under
    ``log_softmax(logits[i])`` (float32) and the ``num_top[i]`` most likely tokens (ties in
    vocabulary order). One host copy for the whole batch."""
    if not len(token_ids):
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=logprobs.device)
    chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).cpu().tolist()
    k = max(num_top)
    top_lp: list[list[float]] = [[] for _ in token_ids]
    top_ids: list[list[int]] = [[] for _ in token_ids]
    if k > 0:
        # Stable descending sort, so equal log-probabilities keep vocabulary order.
        values, indices = logprobs.sort(dim=-1, descending=True, stable=True)
        top_lp = values[:, :k].cpu().tolist()
        top_ids = indices[:, :k].cpu().tolist()
    return [
        TokenLogprob(
            int(t),
            float(lp),
            tuple(zip(top_ids[i][: num_top[i]], top_lp[i][: num_top[i]], strict=True)),
        )
        for i, (t, lp) in enumerate(zip(token_ids, chosen, strict=True))
    ]
