"""Structured output (``response_format`` json_object / json_schema) through xgrammar, the
grammar library vLLM and SGLang use. xgrammar is optional (the ``structured`` extra): only a
request that asks for a grammar needs it, and the server answers such a request with a 400
when it is missing (``check_grammar``).

The model runner keeps one ``GrammarMatcher`` per constrained request (``RequestGrammars``).
Before sampling it masks every token the grammar forbids; after, it feeds the sampled token to
the matcher. A matcher is rebuilt from the request's output tokens whenever it is out of step
with them (a preempted request re-prefills; the runner dropped its state), so the grammar
state always equals the tokens the request holds. JSON is generated without free whitespace
between tokens (``any_whitespace=False``): a model cannot wander in blanks until
``max_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.grammar import INSTALL_HINT, check_grammar, xgrammar_available
from engine.sampling_params import SamplingParams

__all__ = ["INSTALL_HINT", "RequestGrammars", "check_grammar", "xgrammar_available"]


@dataclass(slots=True)
class _Matcher:
    matcher: Any  # xgrammar.GrammarMatcher
    num_accepted: int  # output tokens fed so far


class RequestGrammars:
    """Per-request grammar matchers of one model runner. ``tokenizer``: the model's HF
    tokenizer; ``vocab_size``: the logits' width; ``eos_token_ids``: the tokens that end a
    constrained output. xgrammar is imported on first use. Not thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._compiler: Any = None
        self._compiled: dict[tuple[str | None, bool], Any] = {}
        self._matchers: dict[str, _Matcher] = {}

    def _compile(self, params: SamplingParams) -> Any:
        key = (params.json_schema, params.json_object)
        if key not in self._compiled:
            import xgrammar as xgr

            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._eos or None
                )
                self._compiler = xgr.GrammarCompiler(info)
            if params.json_schema is not None:
                self._compiled[key] = self._compiler.compile_json_schema(
                    params.json_schema, any_whitespace=False
                )
            else:
                self._compiled[key] = self._compiler.compile_json_schema(
                    json.dumps({"type": "object"}), any_whitespace=False
                )
        return self._compiled[key]

    def _matcher(self, req_id: str, params: SamplingParams, outputs: Sequence[int]) -> Any:
        state = self._matchers.get(req_id)
        if state is None or state.num_accepted != len(outputs):
            import xgrammar as xgr

            matcher = xgr.GrammarMatcher(self._compile(params))
            for token in outputs:
                if matcher.is_terminated() or not matcher.accept_token(int(token)):
                    break
            state = _Matcher(matcher, len(outputs))
            self._matchers[req_id] = state
        return state.matcher

    def mask(
        self, logits: torch.Tensor, rows: Sequence[tuple[str, SamplingParams, Sequence[int]] | None]
    ) -> torch.Tensor:
        """``logits`` with every token each constrained row's grammar forbids at -inf (a
        float32 copy if any row is constrained, else ``logits`` itself). A row is
        ``(req_id, params, output tokens so far)`` or None (unconstrained)."""
        if not any(r is not None for r in rows):
            return logits
        import xgrammar as xgr

        out = logits.float().clone()
        bitmask = xgr.allocate_token_bitmask(len(rows), self._vocab_size)
        indices = []
        for i, row in enumerate(rows):
            if row is None:
                continue
            matcher = self._matcher(*row)
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, i)
                indices.append(i)
        if indices:
            xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), indices=indices)
        return out

    def accept(self, req_id: str, token_id: int) -> None:
        """Feeds a sampled token to the request's matcher (if it has one)."""
        state = self._matchers.get(req_id)
        if state is None:
            return
        if not state.matcher.is_terminated():
            state.matcher.accept_token(int(token_id))
        state.num_accepted += 1

    def drop(self, req_ids: Sequence[str] | frozenset[str]) -> None:
        for req_id in req_ids:
            self._matchers.pop(req_id, None)
