"""Engine logprob entries (``engine.outputs.TokenLogprob``) as the OpenAI API shapes them:
the chat API's ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`` and the
completions API's parallel lists (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``). A token's string is its own decoding (``tokenizer.decode([id])``), as
vLLM returns it; ``bytes`` are that string's UTF-8 bytes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.outputs import TokenLogprob
from engine.server.responses import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


class LogprobFormatter:
    """Decodes token ids to strings (memoized: a vocabulary is finite), or names them
    ``token_id:N`` when ``as_ids`` (vLLM's ``return_tokens_as_token_ids``: a token that is
    part of a UTF-8 character decodes to U+FFFD, so a string can be ambiguous). Used from the
    event-loop thread only; ``for_request`` gives the view a request asks for."""

    def __init__(
        self, tokenizer: Any, as_ids: bool = False, strings: dict[int, str] | None = None
    ) -> None:
        self._tokenizer = tokenizer
        self._as_ids = as_ids
        self._strings: dict[int, str] = {} if strings is None else strings

    def for_request(self, as_ids: bool) -> LogprobFormatter:
        return (
            self
            if as_ids == self._as_ids
            else LogprobFormatter(self._tokenizer, as_ids, self._strings)
        )

    def token(self, token_id: int) -> str:
        if self._as_ids:
            return f"token_id:{token_id}"
        text = self._strings.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            if len(self._strings) < 1 << 18:
                self._strings[token_id] = text
        return text

    def chat(self, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
        content = []
        for e in entries:
            text = self.token(e.token_id)
            content.append(
                ChatTokenLogprob(
                    token=text,
                    logprob=e.logprob,
                    bytes=list(text.encode()),
                    top_logprobs=[self._top(i, lp) for i, lp in e.top],
                )
            )
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    def completion(
        self, entries: Sequence[TokenLogprob | None], token_ids: Sequence[int], text_offset: int
    ) -> CompletionLogprobs:
        """One entry per token of ``token_ids`` (an entry may be None: an echoed first prompt
        token); offsets count characters from ``text_offset``. ``top_logprobs`` holds the top
        k and the chosen token, as OpenAI's completions API does (so up to k + 1 keys)."""
        out = CompletionLogprobs()
        offset = text_offset
        for token_id, e in zip(token_ids, entries, strict=True):
            text = self.token(token_id)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if e is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(e.logprob)
            top = {self.token(i): lp for i, lp in e.top}
            top.setdefault(text, e.logprob)
            out.top_logprobs.append(top)
        return out


def merge_completion(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    """``first`` followed by ``second`` (an echoed prompt, then the completion)."""
    return CompletionLogprobs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=first.top_logprobs + second.top_logprobs,
        text_offset=first.text_offset + second.text_offset,
    )
