"""``ChatTokenCache``: chat-template token ids of multi-round conversations without
re-tokenizing the whole history every round.

Round ``r + 1`` of a chat sends the messages of round ``r`` plus the answer and a new
question, so its rendered text usually starts with round ``r``'s rendered text. The cache
keeps, per conversation prefix (a hash chain over the messages), the rendered text, its token
ids and the character offsets of its last tokens. A request whose rendering extends a cached
one reuses the cached ids up to a cut a little before the old end and tokenizes only from
there on.

Correctness guard: BPE tokenization is not a concatenation at an arbitrary cut, so the cut
is taken ``WINDOW_TOKENS`` tokens before the last ``UNTRUSTED_TAIL_TOKENS`` tokens of the old
rendering (those may merge with what follows), on a clean character boundary, and the
re-tokenized window must reproduce the old tokens and offsets exactly; otherwise the full
path runs. The result equals ``encode_chat``'s for every tokenizer whose merges do not reach
further back than that window (byte-level BPE with a pre-tokenizer, as Llama-3 and the demo
tokenizer use, split at pre-token boundaries; an added special token is a hard boundary). A
template that renders earlier messages differently in later rounds simply misses.

Not thread-safe: one per API process, used from its event-loop thread.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.tokenizer import TooManyTokens, check_token_bound, render_chat

WINDOW_TOKENS = 8  # tokens re-tokenized and compared at the cut
UNTRUSTED_TAIL_TOKENS = 4  # old tokens that may merge with the new text
TAIL_OFFSETS_TOKENS = 64  # offsets kept per entry (the cut is searched in this tail)
DEFAULT_MAX_CACHED_TOKENS = 1 << 20


@dataclass(frozen=True, slots=True)
class EncodedChat:
    """Token ids of a rendered conversation and what producing them cost."""

    token_ids: list[int]
    num_reused_tokens: int  # ids taken from an earlier rendering (0: full tokenization)
    template_s: float
    tokenize_s: float


@dataclass(frozen=True, slots=True)
class _Entry:
    text: str
    token_ids: list[int]
    tail_start: int  # index of the first token whose offsets are kept
    tail_offsets: list[tuple[int, int]]


def message_chain(conversation: Sequence[dict[str, Any]]) -> list[bytes]:
    """``h[k]``: a digest of the first ``k + 1`` messages (every key and value, in key order).
    Pure. A collision costs nothing but a miss: a hit is checked against the text."""
    out: list[bytes] = []
    prev = b""
    for message in conversation:
        h = hashlib.blake2b(prev, digest_size=16)
        for key in sorted(message):
            for part in (str(key), str(message[key])):
                data = part.encode("utf-8", "surrogatepass")
                h.update(len(data).to_bytes(8, "little"))
                h.update(data)
        prev = h.digest()
        out.append(prev)
    return out


class ChatTokenCache:
    """LRU of conversation renderings holding at most ``max_cached_tokens`` token ids.

    ``encode`` mutates the cache; it raises what ``encode_chat`` raises (ValueError without a
    chat template, TooManyTokens over ``max_tokens``). ``chat_template``: rendered with this
    template instead of the tokenizer's (``kvtier serve --chat-template``). A tokenizer
    without offsets (not a fast tokenizer) gets no caching, only the full path. ``num_*``
    count the outcomes.
    """

    def __init__(
        self,
        tokenizer: Any,
        max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS,
        chat_template: str | None = None,
    ):
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self._enabled = bool(getattr(tokenizer, "is_fast", False)) and max_cached_tokens > 0
        self._max_tokens = max_cached_tokens
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._num_tokens = 0
        self.num_hits = 0
        self.num_misses = 0
        self.num_guard_failures = 0

    def __len__(self) -> int:
        return len(self._entries)

    def encode(
        self, conversation: Sequence[dict[str, Any]], max_tokens: int | None = None
    ) -> EncodedChat:
        t0 = time.perf_counter()
        text = render_chat(self._tokenizer, conversation, self.chat_template)
        t1 = time.perf_counter()
        if not self._enabled:
            ids = self._full(text, max_tokens)[0]
            return EncodedChat(ids, 0, t1 - t0, time.perf_counter() - t1)
        chain = message_chain(conversation)
        entry = self._lookup(chain, text)
        result = self._extend(entry, text, max_tokens) if entry is not None else None
        if result is None:
            self.num_misses += 1
            ids, offsets = self._full(text, max_tokens)
            start = max(0, len(ids) - TAIL_OFFSETS_TOKENS)
            new = _Entry(text, ids, start, offsets[start:])
            reused = 0
        else:
            self.num_hits += 1
            new, reused = result
        if chain:
            self._store(chain[-1], new)
        return EncodedChat(list(new.token_ids), reused, t1 - t0, time.perf_counter() - t1)

    def encode_once(
        self,
        conversation: Sequence[dict[str, Any]],
        max_tokens: int | None = None,
        **template_options: Any,
    ) -> EncodedChat:
        """``encode`` with ``render_chat``'s other options (``add_generation_prompt``,
        ``continue_final_message``, ``template_kwargs``), tokenized whole and not cached:
        the cache's entries are renderings with the default options."""
        t0 = time.perf_counter()
        text = render_chat(self._tokenizer, conversation, self.chat_template, **template_options)
        t1 = time.perf_counter()
        if max_tokens is not None:
            check_token_bound(self._tokenizer, text, max_tokens)
        ids = list(self._tokenizer.encode(text, add_special_tokens=False))
        return EncodedChat(ids, 0, t1 - t0, time.perf_counter() - t1)

    def _lookup(self, chain: list[bytes], text: str) -> _Entry | None:
        """The longest cached rendering of a message prefix that ``text`` extends."""
        for key in reversed(chain):
            entry = self._entries.get(key)
            if entry is not None and text.startswith(entry.text):
                self._entries.move_to_end(key)
                return entry
        return None

    def _extend(self, old: _Entry, text: str, max_tokens: int | None) -> tuple[_Entry, int] | None:
        """``old`` extended to ``text``, or None when the guard fails."""
        if text == old.text:
            return old, len(old.token_ids)
        n = len(old.token_ids)
        trusted_end = n - UNTRUSTED_TAIL_TOKENS  # tokens [.., trusted_end) cannot change
        j = trusted_end - WINDOW_TOKENS
        offsets = old.tail_offsets
        base = old.tail_start
        # The cut must start a character of its own (a multi-byte character split over
        # several byte-level tokens shares its offsets) so that text[cut:] starts there too.
        while j > base and offsets[j - base][0] < offsets[j - base - 1][1]:
            j -= 1
        if j <= base or j < 1:
            self.num_guard_failures += 1
            return None
        cut = offsets[j - base][0]
        suffix = text[cut:]
        if max_tokens is not None:
            try:
                check_token_bound(self._tokenizer, suffix, max_tokens - j)
            except TooManyTokens as exc:
                raise TooManyTokens(exc.at_least + j, max_tokens) from None
        ids, rel = _tokenize(self._tokenizer, suffix)
        window = trusted_end - j
        expected_offsets = [(a - cut, b - cut) for a, b in offsets[j - base : trusted_end - base]]
        if ids[:window] != old.token_ids[j:trusted_end] or rel[:window] != expected_offsets:
            self.num_guard_failures += 1
            return None
        token_ids = old.token_ids[:j] + ids
        tail_from = max(0, len(rel) - TAIL_OFFSETS_TOKENS)
        tail = [(a + cut, b + cut) for a, b in rel[tail_from:]]
        if len(tail) < TAIL_OFFSETS_TOKENS:  # a short suffix: keep some of the old tail too
            keep = offsets[max(0, j - base - (TAIL_OFFSETS_TOKENS - len(tail))) : j - base]
            tail = keep + tail
        new = _Entry(text, token_ids, len(token_ids) - len(tail), tail)
        return new, j

    def _full(self, text: str, max_tokens: int | None) -> tuple[list[int], list[tuple[int, int]]]:
        if max_tokens is not None:
            check_token_bound(self._tokenizer, text, max_tokens)
        if not self._enabled:
            return list(self._tokenizer.encode(text, add_special_tokens=False)), []
        return _tokenize(self._tokenizer, text)

    def _store(self, key: bytes, entry: _Entry) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._num_tokens -= len(old.token_ids)
        if len(entry.token_ids) > self._max_tokens:
            return
        self._entries[key] = entry
        self._num_tokens += len(entry.token_ids)
        while self._num_tokens > self._max_tokens:
            _, evicted = self._entries.popitem(last=False)
            self._num_tokens -= len(evicted.token_ids)


def _tokenize(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and character offsets, through the same call path as ``tokenizer.encode``."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), list(enc["offset_mapping"])
