"""ChatTokenCache: exact equality with ``encode_chat`` over multi-round conversations, reuse of
earlier rounds, the boundary guard's fallback, the length bound and the LRU budget."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine.chat_tokens import ChatTokenCache, message_chain
from engine.models.demo_model import _CORPUS, build_demo_tokenizer
from engine.tokenizer import TooManyTokens, encode_chat

# Words that stress byte-level BPE at a cut: multi-byte characters split over several tokens,
# combining marks, whitespace runs, contractions the pre-tokenizer splits off.
_ODD = ["😀", "wörld", "日本語", "x\u0301", "  ", "\n\n", "'s", "don't", "\t", "ﬁ", "1234"]


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_demo_tokenizer()


def _text(rng: random.Random, n: int, odd: bool = True) -> str:
    words = _CORPUS.split() + (_ODD if odd else [])
    return " ".join(rng.choice(words) for _ in range(n))


def _rounds(rng: random.Random, system: str, num_rounds: int):
    """Yields the conversation as sent in each round (history, answers, a new question)."""
    conv = [{"role": "system", "content": system}]
    for _ in range(num_rounds):
        conv.append({"role": "user", "content": _text(rng, rng.randint(1, 120))})
        yield list(conv)
        conv.append({"role": "assistant", "content": _text(rng, rng.randint(0, 60))})


def test_multi_round_equals_full_path_and_reuses(tok: Any) -> None:
    rng = random.Random(1)
    cache = ChatTokenCache(tok)
    prev_len = 0
    for conv in _rounds(rng, _text(rng, 200), 12):
        enc = cache.encode(conv)
        full = encode_chat(tok, conv)
        assert enc.token_ids == full
        # Everything of the previous round but the re-tokenized window (and a few tokens
        # more where a multi-byte character straddles the cut).
        assert prev_len - 20 <= enc.num_reused_tokens <= max(0, prev_len - 12)
        prev_len = len(full)
    assert cache.num_hits == 11 and cache.num_misses == 1


def test_interleaved_users_system_prompts_and_edits(tok: Any) -> None:
    rng = random.Random(2)
    cache = ChatTokenCache(tok)
    systems = [_text(rng, 80), _text(rng, 80), ""]
    users = [list(_rounds(random.Random(10 + u), systems[u % 3], 6)) for u in range(5)]
    for r in range(6):
        for u in range(5):
            conv = users[u][r]
            assert cache.encode(conv).token_ids == encode_chat(tok, conv)
    assert cache.num_hits == 25  # every later round of every user
    # An edit to the first question: no cached rendering is a prefix, tokenized in full.
    edited = [dict(m) for m in users[0][5]]
    edited[1]["content"] = edited[1]["content"] + " wörld 😀"
    misses = cache.num_misses
    assert cache.encode(edited).token_ids == encode_chat(tok, edited)
    assert cache.num_misses == misses + 1
    # An edit to the first answer: round 1's rendering (system + question) is still a prefix.
    edited = [dict(m) for m in users[0][5]]
    edited[2]["content"] = "x\u0301 " + edited[2]["content"]
    enc = cache.encode(edited)
    assert enc.token_ids == encode_chat(tok, edited)
    assert 0 < enc.num_reused_tokens < len(cache.encode(users[0][1]).token_ids)
    # A regenerated answer (same history, other last answer) reuses the shared prefix.
    branch = [
        *users[1][4],
        {"role": "assistant", "content": "another answer"},
        {"role": "user", "content": "and then?"},
    ]
    enc = cache.encode(branch)
    assert enc.token_ids == encode_chat(tok, branch) and enc.num_reused_tokens > 0
    # The same request again: every id reused.
    again = cache.encode(branch)
    assert again.token_ids == enc.token_ids and again.num_reused_tokens == len(enc.token_ids)


def test_unicode_at_every_boundary(tok: Any) -> None:
    """Answers ending in split multi-byte characters, whitespace runs or combining marks."""
    cache = ChatTokenCache(tok)
    conv = [{"role": "user", "content": "hello"}]
    endings = ["😀", "x\u0301", "   ", "\n", "日本", "don'", "ﬁ", "", "\U0010ffff", "é" * 40]
    for i, end in enumerate(endings * 3):
        conv = [
            *conv,
            {"role": "assistant", "content": f"the cache {end}"},
            {"role": "user", "content": f"{end}{i} wörld"},
        ]
        assert cache.encode(conv).token_ids == encode_chat(tok, conv)
    assert cache.num_hits >= len(endings)


def _metaspace_tokenizer() -> Any:
    """A tokenizer that prepends '▁' to every text it encodes: a cut inside the text is never
    a concatenation point, so the guard must catch every attempt."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set("abcdefghijklmnopqrstuvwxyz ▁\n<|>/"))
    vocab = {"<unk>": 0, "<s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=False)
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", chat_template=template)


def test_guard_falls_back_when_a_cut_is_not_a_boundary() -> None:
    tok = _metaspace_tokenizer()
    rng = random.Random(3)
    cache = ChatTokenCache(tok)
    for conv in _rounds(rng, "be brief", 5):
        conv = [
            {"role": m["role"], "content": m["content"].encode("ascii", "ignore").decode()}
            for m in conv
        ]
        assert cache.encode(conv).token_ids == encode_chat(tok, conv)
    assert cache.num_hits == 0 and cache.num_guard_failures == 4


def test_length_bound_counts_the_reused_prefix(tok: Any) -> None:
    rng = random.Random(4)
    cache = ChatTokenCache(tok)
    conv = [{"role": "user", "content": _text(rng, 300, odd=False)}]
    n = len(cache.encode(conv).token_ids)
    conv += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "the " * 20_000}]
    with pytest.raises(TooManyTokens) as info:
        cache.encode(conv, max_tokens=n + 1000)
    assert info.value.at_least > n + 1000
    with pytest.raises(TooManyTokens):
        encode_chat(tok, conv, n + 1000)  # the full path agrees


def test_lru_budget_bounds_what_is_kept(tok: Any) -> None:
    rng = random.Random(5)
    cache = ChatTokenCache(tok, max_cached_tokens=3000)
    convs = [next(_rounds(random.Random(u), _text(rng, 300), 1)) for u in range(6)]
    for conv in convs:
        assert cache.encode(conv).token_ids == encode_chat(tok, conv)
    assert 1 <= len(cache) < 6  # oldest conversations evicted
    assert cache.encode(convs[0]).num_reused_tokens == 0  # evicted: tokenized again


def test_message_chain_is_prefix_stable() -> None:
    a = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    b = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "z"}]
    assert message_chain(a)[0] == message_chain(b)[0]
    assert message_chain(a)[1] != message_chain(b)[1]
    # Field boundaries are length-prefixed: moving a character across them changes the key.
    assert message_chain([{"role": "ab", "content": "c"}]) != message_chain(
        [{"role": "a", "content": "bc"}]
    )
