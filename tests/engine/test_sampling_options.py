"""vLLM's ``min_tokens`` masking, ``min_p`` and ``allowed_token_ids``: their validation, the
runner's token masks on exact logits, the wire format, and end to end on a tiny llama whose EOS
is the greedy first output of ``PROMPT`` (so a request without ``min_tokens`` ends at once)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.messages import AddRequest, decode_request, encode_request
from engine.request import Request
from engine.runner.logits_processors import MaskRow, mask_tokens
from tests.engine.hf_models import build_tiny_hf_model, make_tiny_model

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]

PROMPT = [5, 17, 99, 230, 41, 8]
VOCAB = 512
INF = float("-inf")


def test_sampling_params_validate_min_p_and_allowed_token_ids() -> None:
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"^min_p must be in \[0, 1\]"):
            SamplingParams(min_p=bad)
    for bad_ids in ([], [3, -1]):
        with pytest.raises(ValueError, match="^allowed_token_ids must be a non-empty list"):
            SamplingParams(allowed_token_ids=bad_ids)  # type: ignore[arg-type]
    params = SamplingParams(min_p=1.0, allowed_token_ids=[4, 9])  # type: ignore[arg-type]
    assert params.allowed_token_ids == (4, 9) and params.min_p == 1.0
    assert SamplingParams().allowed_token_ids is None and SamplingParams().min_p == 0.0
    # Neither needs the token history: the runner gets the mask ids with the step.
    assert not params.needs_history and not SamplingParams(min_tokens=3).needs_history


def test_new_fields_cross_the_wire() -> None:
    for params in (
        SamplingParams(min_p=0.25, allowed_token_ids=(7, 3), min_tokens=2),
        SamplingParams(allowed_token_ids=None),
    ):
        msg = AddRequest("r", [1, 2], params, 1.0)
        back = decode_request(encode_request(msg))
        assert back == msg
        assert back.params.allowed_token_ids == params.allowed_token_ids  # type: ignore[union-attr]


def test_min_tokens_stop_ids_are_stop_ids_and_eos_until_min_tokens() -> None:
    params = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(9, 4), ignore_eos=True)
    request = Request("r", [1, 2], params, eos_token_ids=frozenset({2, 7}))
    # EOS is masked even with ignore_eos: vLLM's all_stop_token_ids holds it regardless.
    assert request.min_tokens_stop_ids() == (2, 4, 7, 9)
    request.append_output_token(5)
    assert request.min_tokens_stop_ids() == (2, 4, 7, 9)  # the 2nd output is still masked
    request.append_output_token(5)
    assert request.min_tokens_stop_ids() == ()
    plain = Request("p", [1], SamplingParams(stop_token_ids=(9,)), eos_token_ids=frozenset({2}))
    assert plain.min_tokens_stop_ids() == ()


def test_mask_tokens_sets_exactly_the_masked_logits_per_row() -> None:
    logits = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    rows = [
        MaskRow(allowed=(1, 4)),
        None,
        MaskRow(banned=(0, 5)),
        MaskRow(allowed=(2, 3), banned=(3,)),  # banned wins over allowed
    ]
    got = mask_tokens(logits, rows)
    want = logits.clone()
    want[0, [0, 2, 3, 5]] = INF
    want[2, [0, 5]] = INF
    want[3, [0, 1, 3, 4, 5]] = INF
    assert torch.equal(got, want)  # row 1 untouched: no mask leaks between rows
    assert torch.equal(logits, torch.arange(24, dtype=torch.float32).reshape(4, 6))
    assert mask_tokens(logits, [None, None]) is logits  # nobody masks: no copy


# --- end to end ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eos_llm(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, int]:
    """A tiny llama whose EOS is its greedy first token after ``PROMPT`` (found with the HF
    model of the same seed: the EOS id is config only, the weights stay the same)."""
    hf = build_tiny_hf_model("llama", seed=3)
    with torch.no_grad():
        eos = int(hf(torch.tensor([PROMPT])).logits[0, -1].argmax())
    model_dir = make_tiny_model(Path(tmp_path_factory.mktemp("eos")), "llama", 3, eos_token_id=eos)
    llm = LLM(model_dir, num_gpu_blocks=64, dtype="float32", device="cpu")
    assert llm.engine.eos_token_ids == {eos}
    return llm, eos


def _greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0.0, **kwargs)  # type: ignore[arg-type]


def test_min_tokens_masks_eos_for_greedy_requests(eos_llm: tuple[LLM, int]) -> None:
    llm, eos = eos_llm
    (plain,) = llm.generate([PROMPT], _greedy())
    assert (plain.token_ids, plain.finish_reason, plain.stop_reason) == ([eos], "stop", None)
    (ignored,) = llm.generate([PROMPT], _greedy(ignore_eos=True))
    assert ignored.token_ids[0] == eos  # ignore_eos alone: EOS is sampled into the output
    (held,) = llm.generate([PROMPT], _greedy(min_tokens=5))
    assert len(held.token_ids) >= 5 and eos not in held.token_ids[:5]
    assert held.text == llm.tokenizer.decode(held.token_ids, skip_special_tokens=True)
    # vLLM masks EOS under min_tokens even with ignore_eos: the same tokens.
    (held_ignoring,) = llm.generate([PROMPT], _greedy(min_tokens=5, ignore_eos=True))
    assert held_ignoring.token_ids == held.token_ids


def test_min_tokens_masks_every_stop_token_id(eos_llm: tuple[LLM, int]) -> None:
    llm, eos = eos_llm
    (held,) = llm.generate([PROMPT], _greedy(min_tokens=5))
    # The next greedy choices become stop ids too: each would end the request at once.
    stop_ids = (eos, *held.token_ids[:2])
    (plain,) = llm.generate([PROMPT], _greedy(ignore_eos=True, stop_token_ids=stop_ids))
    assert (plain.token_ids, plain.finish_reason, plain.stop_reason) == ([eos], "stop", eos)
    (o,) = llm.generate([PROMPT], _greedy(min_tokens=5, stop_token_ids=stop_ids))
    assert len(o.token_ids) >= 5
    assert not set(o.token_ids[:5]) & set(stop_ids)
    assert o.token_ids[0] not in (eos, held.token_ids[0])  # the third choice, then on


def test_min_tokens_masks_eos_for_sampled_requests(eos_llm: tuple[LLM, int]) -> None:
    llm, eos = eos_llm
    seeds = range(8)
    free = llm.generate([PROMPT] * 8, [SamplingParams(max_tokens=8, seed=s) for s in seeds])
    assert sum(o.token_ids == [eos] for o in free) >= 2  # EOS-prone: several end at once
    held = llm.generate(
        [PROMPT] * 8, [SamplingParams(max_tokens=8, seed=s, min_tokens=4) for s in seeds]
    )
    for o in held:
        assert len(o.token_ids) >= 4 and eos not in o.token_ids[:4], o.token_ids


def test_min_p_one_is_greedy_and_zero_does_not_restrict(eos_llm: tuple[LLM, int]) -> None:
    llm, _ = eos_llm
    (greedy,) = llm.generate([PROMPT], _greedy(ignore_eos=True))
    hot = [SamplingParams(max_tokens=8, temperature=5.0, seed=s, ignore_eos=True) for s in range(4)]
    only_top = llm.generate([PROMPT] * 4, [SamplingParams(**_fields(p), min_p=1.0) for p in hot])
    assert all(o.token_ids == greedy.token_ids for o in only_top)
    free = llm.generate([PROMPT] * 4, hot)  # min_p 0: at temperature 5 the draws wander
    assert all(o.token_ids != greedy.token_ids for o in free)
    assert len({t for o in free for t in o.token_ids}) > 20


def _fields(params: SamplingParams) -> dict[str, object]:
    return {"max_tokens": params.max_tokens, "temperature": params.temperature,
            "seed": params.seed, "ignore_eos": params.ignore_eos}  # fmt: skip


def test_allowed_token_ids_restrict_the_output(eos_llm: tuple[LLM, int]) -> None:
    llm, _ = eos_llm
    (greedy,) = llm.generate([PROMPT], _greedy(allowed_token_ids=(300,)))
    assert greedy.token_ids == [300] * 8 and greedy.finish_reason == "length"
    sampled = llm.generate(
        [PROMPT] * 4,
        [SamplingParams(max_tokens=8, seed=s, allowed_token_ids=(7, 300)) for s in range(4)],
    )
    seen = {t for o in sampled for t in o.token_ids}
    assert seen == {7, 300}
    with pytest.raises(ValueError, match=r"^allowed_token_ids \[512\] outside the vocabulary"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=(3, VOCAB)))
    assert not llm.engine.has_unfinished_requests()


def test_one_batch_gives_each_request_its_own_options(eos_llm: tuple[LLM, int]) -> None:
    """Masked rows next to plain ones in the same steps: nothing leaks between rows."""
    llm, eos = eos_llm
    (held_alone,) = llm.generate([PROMPT], _greedy(min_tokens=5))
    (greedy,) = llm.generate([PROMPT], _greedy(ignore_eos=True))
    params = [
        _greedy(min_tokens=5),
        _greedy(),
        _greedy(allowed_token_ids=(300,)),
        SamplingParams(max_tokens=8, temperature=5.0, seed=1, min_p=1.0, ignore_eos=True),
        _greedy(ignore_eos=True),
    ]
    outs = llm.generate([PROMPT] * len(params), params)
    assert outs[0].token_ids == held_alone.token_ids
    assert outs[1].token_ids == [eos] and outs[1].finish_reason == "stop"
    assert outs[2].token_ids == [300] * 8
    assert outs[3].token_ids == greedy.token_ids
    assert outs[4].token_ids == greedy.token_ids
