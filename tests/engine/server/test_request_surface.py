"""The OpenAI request surface a vLLM user reaches for, through the ``openai`` client against
the real server (uvicorn, the engine core in its own process, a tiny random-weight llama),
checked against Hugging Face transformers on the same weights (float32, CPU): cached-token
counts, logprobs, echo with prompt logprobs, n > 1 sharing the prompt's blocks, penalties,
seeds and response_format."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import jsonschema
import openai
import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.client import CoreProcConfig, EngineCoreClient
from engine.tokenizer import load_tokenizer
from tests.engine.hf_models import make_tiny_model
from tests.engine.test_server import _wait_idle, run_server

pytestmark = pytest.mark.timeout(120)
MODEL = "tiny-llama"
BLOCK_SIZE = 16
PROMPT = "The cache keeps every block of the prompt, and the tiers below keep the rest"


@dataclass
class Served:
    base_url: str
    engine: EngineCoreClient
    hf: torch.nn.Module  # the same weights in transformers, the reference
    tokenizer: object

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0)

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]  # type: ignore[operator]

    def hf_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """log_softmax of the HF model's logits at every position of ``token_ids``."""
        with torch.no_grad():
            logits = self.hf(torch.tensor([token_ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model(tmp_path_factory.mktemp("surface"), "llama", seed=7)
    config = EngineConfig(
        model=model_dir,
        device="cpu",
        cache=CacheConfig(num_gpu_blocks=96, block_size=BLOCK_SIZE),
        scheduler=SchedulerConfig(max_model_len=256),
    )
    engine = EngineCoreClient.start(config, CoreProcConfig(num_threads=1))
    try:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with run_server(engine, MODEL) as base_url:
            yield Served(base_url, engine, hf, load_tokenizer(model_dir))
    finally:
        engine.shutdown()


def test_cached_tokens_zero_then_the_engines_count(served: Served) -> None:
    """First turn: nothing cached. The same prompt again: ``cached_tokens`` is the prefix the
    engine reused (the full blocks, the last token always recomputed), per tier too, and the
    engine's own prefix-hit counter moved by exactly that; streamed usage says the same."""
    messages = [{"role": "user", "content": "A first turn that nobody asked before " * 3}]
    first = served.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=3,
        temperature=0,  # type: ignore[arg-type]
    )
    details = first.usage.prompt_tokens_details  # type: ignore[union-attr]
    assert details.cached_tokens == 0
    assert details.model_extra["kvtier_cached_tokens_by_tier"] == {}
    _wait_idle(served)  # type: ignore[arg-type]
    before = served.engine.stats()["prefix_cache_hit_tokens_total"]
    second = served.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=3,
        temperature=0,  # type: ignore[arg-type]
    )
    prompt_tokens = second.usage.prompt_tokens  # type: ignore[union-attr]
    expected = (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    details = second.usage.prompt_tokens_details  # type: ignore[union-attr]
    _wait_idle(served)  # type: ignore[arg-type]
    engine_count = served.engine.stats()["prefix_cache_hit_tokens_total"] - before
    assert expected > 0 and details.cached_tokens == expected == engine_count
    assert details.model_extra["kvtier_cached_tokens_by_tier"] == {"gpu": expected}
    stream = served.client.completions.create(
        model=MODEL,
        prompt=second_prompt_ids(served, messages),
        max_tokens=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens == expected


def second_prompt_ids(served: Served, messages: list[dict[str, str]]) -> list[int]:
    return served.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


def test_chat_top_logprobs_match_transformers(served: Served) -> None:
    """Greedy chat with ``logprobs`` + ``top_logprobs=5``: every token is HF's argmax and its
    logprob and top 5 equal HF's log_softmax within 1e-3, streamed or not."""
    messages = [{"role": "user", "content": "Which tier holds the block?"}]
    resp = served.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=5,
        extra_body=AS_IDS,
    )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(content) == resp.usage.completion_tokens == 6  # type: ignore[union-attr]
    ids = second_prompt_ids(served, messages)
    ref = served.hf_logprobs(ids + [_token_id(served, e.token) for e in content][:-1])
    for step, entry in enumerate(content):
        row = ref[len(ids) - 1 + step]
        top_vals, top_ids = row.topk(5)
        assert _token_id(served, entry.token) == int(top_ids[0])
        assert entry.logprob == pytest.approx(float(top_vals[0]), abs=1e-3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top_vals.tolist(), abs=1e-3)
        assert [_token_id(served, t.token) for t in entry.top_logprobs] == top_ids.tolist()
        assert entry.bytes is not None
    stream = served.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=5,
        stream=True,
        extra_body=AS_IDS,
    )
    streamed = [e for c in stream for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content
    ]


def _token_id(served: Served, token: str) -> int:
    """Tokens come as ``token_id:N`` (``return_tokens_as_token_ids``, vLLM's extension)."""
    assert token.startswith("token_id:"), token
    return int(token.removeprefix("token_id:"))


AS_IDS = {"return_tokens_as_token_ids": True}


def test_echo_logprobs_are_hf_prompt_logprobs_even_when_cached(served: Served) -> None:
    """``echo`` + ``logprobs``: the prompt's tokens come first, the first with None, each
    other with HF's log-probability given the tokens before it; asked again, when the prompt
    is in the prefix cache, the same values (the request recomputes its prompt)."""
    ids = served.ids(PROMPT)
    ref = served.hf_logprobs(ids)
    runs = []
    for _ in range(2):
        resp = served.client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1
        )
        choice = resp.choices[0]
        assert choice.text.startswith(PROMPT)
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + 1  # type: ignore[union-attr]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # type: ignore[union-attr]
        want = [float(ref[p - 1, ids[p]]) for p in range(1, len(ids))]
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=1e-3)  # type: ignore[union-attr]
        runs.append(lp.token_logprobs)  # type: ignore[union-attr]
        assert resp.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert runs[0] == pytest.approx(runs[1], abs=1e-5)
    plain = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert plain.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]


def test_completion_logprobs_k(served: Served) -> None:
    """Completions ``logprobs: 3``: each token's top 3 (and itself) as a token -> logprob map,
    equal to HF's; offsets count characters of the text."""
    resp = served.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3, extra_body=AS_IDS
    )
    lp = resp.choices[0].logprobs
    ids = served.ids(PROMPT)
    gen = [_token_id(served, t) for t in lp.tokens]  # type: ignore[union-attr]
    ref = served.hf_logprobs(ids + gen[:-1])
    for step, top in enumerate(lp.top_logprobs):  # type: ignore[union-attr]
        vals, top_ids = ref[len(ids) - 1 + step].topk(3)
        assert {_token_id(served, t): v for t, v in top.items()} == pytest.approx(
            dict(zip(top_ids.tolist(), vals.tolist(), strict=True)), abs=1e-3
        )
    assert lp.text_offset[0] == 0  # type: ignore[union-attr]


def test_n_samples_share_the_prompt(served: Served) -> None:
    """``n=3``: three choices; the prompt is computed by the first sample only, the other two
    reuse its blocks (the engine's prefix-hit counter moves by two prompts' full blocks) and
    usage counts the prompt once. A seed makes the three reproducible, not identical."""
    prompt = "Three samples of one prompt share its blocks in the pool " * 2
    num_prompt = len(served.ids(prompt))
    _wait_idle(served)  # type: ignore[arg-type]
    before = served.engine.stats()
    resp = served.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=1.0, seed=11, n=3
    )
    _wait_idle(served)  # type: ignore[arg-type]
    after = served.engine.stats()
    assert [c.index for c in resp.choices] == [0, 1, 2]
    full_blocks = (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    hits = after["prefix_cache_hit_tokens_total"] - before["prefix_cache_hit_tokens_total"]
    assert full_blocks > 0 and hits == 2 * full_blocks
    assert resp.usage.prompt_tokens == num_prompt  # type: ignore[union-attr]
    assert resp.usage.completion_tokens == 15  # type: ignore[union-attr]
    again = served.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=1.0, seed=11, n=3
    )
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]
    assert len({c.text for c in resp.choices}) > 1
    chat = served.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=3,
        n=2,
        stream=True,
        seed=1,
    )
    finished = {ch.index for c in chat for ch in c.choices if ch.finish_reason}
    assert finished == {0, 1}


def _hf_greedy(served: Served, ids: list[int], steps: int, processors: list) -> list[int]:
    from transformers import LogitsProcessorList

    seq = list(ids)
    procs = LogitsProcessorList(processors)
    for _ in range(steps):
        with torch.no_grad():
            logits = served.hf(torch.tensor([seq])).logits[:, -1, :].float()
        seq.append(int(procs(torch.tensor([seq]), logits).argmax(-1)))
    return seq[len(ids) :]


class _OpenAIPenalties:
    """OpenAI's frequency/presence penalty as a transformers logits processor (output tokens
    only: those after ``num_prompt``)."""

    def __init__(self, num_prompt: int, frequency: float, presence: float) -> None:
        self.num_prompt, self.frequency, self.presence = num_prompt, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(input_ids[0, self.num_prompt :], minlength=scores.shape[-1])
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 1.8},
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"repetition_penalty": 1.3, "frequency_penalty": 0.7},
    ],
)
def test_penalties_follow_transformers(served: Served, penalties: dict[str, float]) -> None:
    """Greedy with penalties equals HF greedy with ``RepetitionPenaltyLogitsProcessor``
    (prompt and output) and OpenAI's frequency/presence formula (output), and differs from
    greedy without them."""
    from transformers import RepetitionPenaltyLogitsProcessor

    ids = served.ids(PROMPT)
    procs: list = []
    if "repetition_penalty" in penalties:
        procs.append(RepetitionPenaltyLogitsProcessor(penalties["repetition_penalty"]))
    procs.append(
        _OpenAIPenalties(
            len(ids),
            penalties.get("frequency_penalty", 0.0),
            penalties.get("presence_penalty", 0.0),
        )
    )
    want = _hf_greedy(served, ids, 24, procs)
    extra = {k: v for k, v in penalties.items() if k == "repetition_penalty"}
    openai_args = {k: v for k, v in penalties.items() if k != "repetition_penalty"}
    resp = served.client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=24,
        temperature=0,
        logprobs=0,
        extra_body={**extra, **AS_IDS, "ignore_eos": True},
        **openai_args,
    )
    got = [_token_id(served, t) for t in resp.choices[0].logprobs.tokens]  # type: ignore[union-attr]
    assert got == want
    plain = _hf_greedy(served, ids, 24, [])
    assert got != plain


def test_same_seed_same_result_with_penalties(served: Served) -> None:
    args = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0.9,
        seed=1234,
        frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.2},
    )
    a = served.client.completions.create(**args)  # type: ignore[arg-type]
    b = served.client.completions.create(**args)  # type: ignore[arg-type]
    c = served.client.completions.create(**{**args, "seed": 4321})  # type: ignore[arg-type]
    assert a.choices[0].text == b.choices[0].text != c.choices[0].text


SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "tier": {"enum": ["gpu", "host", "lmdb"]},
        "blocks": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["ok", "tier", "blocks"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", [0, 1])
def test_json_schema_response_parses_and_validates(served: Served, seed: int) -> None:
    resp = served.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Report the tier."}],  # type: ignore[arg-type]
        max_tokens=80,
        temperature=1.0,
        seed=seed,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "report", "schema": SCHEMA},
        },  # type: ignore[typeddict-item]
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_json_object_output_stays_json(served: Served) -> None:
    """``json_object`` on a random-weight model never finishes its first string value, so
    this checks the constraint token by token: every returned token is one xgrammar's JSON
    grammar accepts in turn (an unconstrained greedy output does not even start with '{')."""
    import xgrammar as xgr

    resp = served.client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=30,
        temperature=0.0,
        logprobs=0,
        extra_body={"response_format": {"type": "json_object"}, **AS_IDS},
    )
    choice = resp.choices[0]
    assert choice.text.startswith("{")
    info = xgr.TokenizerInfo.from_huggingface(served.tokenizer, vocab_size=512)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_builtin_json_grammar())
    tokens = [_token_id(served, t) for t in choice.logprobs.tokens]  # type: ignore[union-attr]
    assert len(tokens) == 30 and all(matcher.accept_token(t) for t in tokens)
    plain = served.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0.0
    )
    assert not plain.choices[0].text.startswith("{")


def test_streamed_echo_equals_non_streamed(served: Served) -> None:
    """A stream with ``echo`` + ``logprobs`` sends the prompt (text and logprobs) in its
    choice's first chunk; joined, the chunks equal the non-streamed choice."""
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2)
    whole = served.client.completions.create(**args).choices[0]  # type: ignore[arg-type]
    chunks = [
        c.choices[0]
        for c in served.client.completions.create(**args, stream=True)  # type: ignore[arg-type]
        if c.choices
    ]
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens] == whole.logprobs.tokens  # type: ignore[union-attr]
    assert [o for lp in streamed for o in lp.text_offset] == whole.logprobs.text_offset  # type: ignore[union-attr]
    values = [v for lp in streamed for v in lp.token_logprobs]
    assert values[0] is None and whole.logprobs.token_logprobs[0] is None  # type: ignore[union-attr]
    assert values[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-5)  # type: ignore[union-attr]
