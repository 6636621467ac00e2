"""Short steps for first tokens: a step that yields a request's first token from a short
prefill trims the step's other prefill chunks (unfinished ones, and the last chunk of a long
prompt), so that first token is not held behind another request's 2K-token chunk. The same
holds for a decode whose request has sampled only tokens that show no text yet (a piece of a
UTF-8 character, a skipped special token: ``ScheduledRequest.awaits_text``): its user's first
token is the first one with text. Pure: works on the step's scheduled slices only.
"""

from __future__ import annotations

import dataclasses

from engine.core_types import ScheduledRequest


def shorten_for_first_tokens(
    scheduled: list[ScheduledRequest], cap: int, others_cap: int = -1
) -> int:
    """If ``scheduled`` yields a first token from a short prefill (at most ``cap`` tokens) or
    decodes a request that shows no text yet (``awaits_text``),
    cut its other prefill chunks so the step carries at most ``cap`` prefill tokens (the others
    at least a quarter of it; with ``others_cap`` >= 0, the others carry at most that many tokens
    whatever room the cap leaves): unfinished chunks, and the last chunk of a longer prefill too
    (it then samples nothing this step: its first token is one step later, where the short
    one's would have waited for the whole chunk). A chunk cut to nothing is dropped from the
    step (its request stays RUNNING with its blocks). Decodes are never cut. Mutates
    ``scheduled``; returns the tokens given back (0 when ``cap`` <= 0)."""
    if cap <= 0:
        return 0
    first = [
        s
        for s in scheduled
        if s.sample
        and (
            (s.num_output_tokens == 0 and 1 < len(s.token_ids) <= cap)
            or (s.awaits_text and len(s.token_ids) == 1)
        )
    ]
    if not first:
        return 0
    short = {id(s) for s in first}
    others = [i for i, s in enumerate(scheduled) if len(s.token_ids) > 1 and id(s) not in short]
    # Long prompts always advance by at least a quarter of the cap.
    room = (
        max(cap - sum(len(s.token_ids) for s in first), cap // 4) if others_cap < 0 else others_cap
    )
    return _cut(scheduled, others, room)


def cap_prefill_tokens(scheduled: list[ScheduledRequest], cap: int) -> int:
    """Cut the step's prefill chunks (more than one token) so that they carry at most ``cap``
    tokens in all, in the step's order (decodes first, then the shortest prefills: a short
    suffix that samples keeps its chunk); a cut chunk samples nothing, one cut to nothing
    leaves the step (its request stays RUNNING with its blocks). Decodes are never cut.
    Mutates ``scheduled``; returns the tokens given back (0 when ``cap`` <= 0)."""
    if cap <= 0:
        return 0
    return _cut(scheduled, [i for i, s in enumerate(scheduled) if len(s.token_ids) > 1], cap)


def _cut(scheduled: list[ScheduledRequest], chunks: list[int], room: int) -> int:
    """The chunks at ``chunks`` (ascending indices into ``scheduled``) keep ``room`` tokens
    between them, in that order; a cut chunk samples nothing, one cut to nothing leaves the
    step. Mutates ``scheduled``; returns the tokens given back."""
    deferred = 0
    drop: list[int] = []
    for i in chunks:
        old = scheduled[i]
        keep = min(len(old.token_ids), room)
        room -= keep
        if keep == len(old.token_ids):
            continue
        deferred += len(old.token_ids) - keep
        if keep == 0:
            drop.append(i)
        else:
            scheduled[i] = dataclasses.replace(old, token_ids=old.token_ids[:keep], sample=False)
    for i in reversed(drop):
        del scheduled[i]
    return deferred
