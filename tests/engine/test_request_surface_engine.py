"""The request surface below the HTTP layer: penalties against transformers' processors on the
same logits, cached tokens split by tier (a host-tier load), prompt logprobs that bypass every
cache, the wire format of the new output fields, and the 400 when xgrammar is missing."""

from __future__ import annotations

import random
import sys

import pytest
import torch

from engine.core.messages import CoreOutput, StepOutputs, decode_event, encode_event
from engine.llm import LLM
from engine.outputs import TokenLogprob
from engine.runner.logits_processors import PenaltyRow, apply_penalties, token_logprobs
from engine.sampling_params import SamplingParams
from tests.engine.hf_models import make_tiny_model

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_is_transformers_processor(penalty: float) -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 3
    history = [[1, 4, 4, 9, 30], [7], [2, 2, 49, 0]]
    rows = [PenaltyRow(SamplingParams(repetition_penalty=penalty), h, 2) for h in history]
    got = apply_penalties(logits, rows)
    for i, h in enumerate(history):
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([h]), logits[i : i + 1])
        torch.testing.assert_close(got[i : i + 1], want)


def test_frequency_presence_are_openais_formula_on_outputs_only() -> None:
    logits = torch.zeros(2, 10)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    rows = [PenaltyRow(params, [3, 3, 5, 3, 3, 7], 3), None]  # outputs: 3, 3, 7
    got = apply_penalties(logits, rows)
    want = torch.zeros(10)
    want[3] = -(0.5 * 2 + 1.0)
    want[7] = -(0.5 + 1.0)
    torch.testing.assert_close(got[0], want)  # the prompt's 5 and two 3s are not counted
    torch.testing.assert_close(got[1], torch.zeros(10))
    assert apply_penalties(logits, [None, None]) is logits  # no penalties: no copy


def test_token_logprobs_are_log_softmax_with_stable_top_k() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    entries = token_logprobs(logits, [0, 3], [2, 0])
    ref = torch.log_softmax(logits, dim=-1)
    assert entries[0].logprob == pytest.approx(float(ref[0, 0]))
    assert [i for i, _ in entries[0].top] == [1, 2]  # a tie keeps vocabulary order
    assert entries[1].top == ()


def test_sampling_params_validate_the_new_fields() -> None:
    for bad in (
        {"presence_penalty": 2.5},
        {"frequency_penalty": float("nan")},
        {"repetition_penalty": 0.0},
        {"logprobs": 21},
        {"prompt_logprobs": -1},
        {"json_schema": "{}", "json_object": True},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]
    assert SamplingParams(frequency_penalty=0.1).needs_history
    assert not SamplingParams(logprobs=5).needs_history


def test_new_output_fields_cross_the_wire() -> None:
    entry = TokenLogprob(7, -0.5, ((7, -0.5), (3, -1.25)))
    out = CoreOutput(
        "r",
        [7],
        False,
        None,
        None,
        16,
        1.0,
        1.0,
        None,
        None,
        num_cached_tokens_by_tier={"gpu": 16},
        prompt_logprobs=[None, entry.to_plain()],
        new_logprobs=[entry.to_plain()],
    )
    back = decode_event(encode_event(StepOutputs([out], {})))
    got = back.outputs[0]  # type: ignore[union-attr]
    assert got.num_cached_tokens_by_tier == {"gpu": 16}
    assert TokenLogprob.from_plain(got.new_logprobs[0]) == entry
    assert got.prompt_logprobs[0] is None
    assert decode_event(
        encode_event(
            StepOutputs([CoreOutput("r", [1], False, None, None, 0, None, None, None)], {})
        )
    )


def test_response_format_without_xgrammar_is_a_400(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.server.protocol import ChatCompletionRequest, ProtocolError

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], response_format={"type": "json_object"}
    )
    with pytest.raises(ProtocolError) as info:
        request.check_supported()
    assert info.value.param == "response_format" and "kvtier[structured]" in str(info.value)
    ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], response_format={"type": "text"}
    ).check_supported()


@pytest.fixture(scope="module")
def offload_llm(tmp_path_factory: pytest.TempPathFactory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("surface"), "qwen2", seed=3)
    config = {"decision": "load", "tiers": [{"kind": "host", "capacity": "4MiB"}]}
    with LLM(
        model_dir,
        num_gpu_blocks=8,
        max_num_seqs=2,
        dtype="float32",
        device="cpu",
        kv_offload=True,
        kv_offload_config=config,
    ) as llm:
        yield llm


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def test_cached_tokens_by_tier_counts_a_host_load(offload_llm: LLM) -> None:
    """A prompt whose GPU blocks were evicted comes back from the host tier: its cached
    tokens are all "host", and equal to what the connector loaded for it."""
    rng = random.Random(1)
    target = _prompt(rng, 40)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    first = offload_llm.generate([target], greedy)[0]
    assert first.num_cached_tokens == 0 and first.num_cached_tokens_by_tier == {}
    for n in (60, 60):  # fill the 8-block pool: the target's blocks leave the GPU
        offload_llm.generate([_prompt(rng, n)], greedy)
    loaded_before = offload_llm.kv_stats()["loaded_tokens"]
    again = offload_llm.generate([target], greedy)[0]
    loaded = offload_llm.kv_stats()["loaded_tokens"] - loaded_before
    assert again.num_cached_tokens == 32 == loaded
    assert again.num_cached_tokens_by_tier == {"host": 32}
    assert again.token_ids == first.token_ids


def test_prompt_logprobs_bypass_the_tiers(offload_llm: LLM) -> None:
    """Prompt logprobs of a prompt the host tier holds: no tier load, no GPU hit, and the
    same values as when nothing was cached."""
    rng = random.Random(2)
    target = _prompt(rng, 37)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2, logprobs=1)
    cold = offload_llm.generate([target], params)[0]
    warm = offload_llm.generate([target], params)[0]
    assert cold.num_cached_tokens == warm.num_cached_tokens == 0
    assert cold.prompt_logprobs[0] is None and len(cold.prompt_logprobs) == 37
    assert cold.prompt_logprobs == warm.prompt_logprobs
    assert cold.logprobs == warm.logprobs and len(cold.logprobs) == 1
    plain = offload_llm.generate([target], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert plain.num_cached_tokens == 32  # its blocks were cached all the same


def test_grammar_state_is_rebuilt_from_the_request_tokens(tmp_path) -> None:
    """A preempted request loses its runner state; its matcher is rebuilt from the output
    tokens it holds, so the next mask equals the one an uninterrupted matcher gives."""
    pytest.importorskip("xgrammar")
    from engine.models.demo_model import TOKENIZER_VOCAB_SIZE, save_demo_tokenizer
    from engine.runner.structured_output import RequestGrammars
    from engine.tokenizer import load_tokenizer

    save_demo_tokenizer(str(tmp_path))
    tokenizer = load_tokenizer(str(tmp_path))
    params = SamplingParams(json_object=True)
    logits = torch.zeros(1, TOKENIZER_VOCAB_SIZE)
    steady = RequestGrammars(tokenizer, TOKENIZER_VOCAB_SIZE, [2])
    first = int(steady.mask(logits, [("r", params, [])]).argmax())
    assert tokenizer.decode([first]).startswith("{")
    steady.accept("r", first)
    want = steady.mask(logits, [("r", params, [first])])
    rebuilt = RequestGrammars(tokenizer, TOKENIZER_VOCAB_SIZE, [2])
    rebuilt.mask(logits, [("r", params, [])])
    rebuilt.drop(["r"])  # preempted: the runner dropped it
    got = rebuilt.mask(logits, [("r", params, [first])])
    assert torch.equal(got, want) and bool((want == float("-inf")).any())
