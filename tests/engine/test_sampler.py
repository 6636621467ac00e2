"""Sampler: greedy, top-k, top-p nucleus, temperature, and batch-independent seeds."""

from __future__ import annotations

import math

import pytest
import torch

from engine.runner.sampler import Sampler, SampleRequest, seeded_uniform
from engine.sampling_params import SamplingParams


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def test_greedy_is_argmax_and_top_k1_equals_greedy() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    expected = logits.argmax(-1).tolist()
    greedy = [SampleRequest(SamplingParams(temperature=0.0), 0)] * 6
    assert Sampler(0)(logits, greedy) == expected
    top1 = [SampleRequest(SamplingParams(temperature=1.5, top_k=1), n) for n in range(6)]
    assert Sampler(1)(logits, top1) == expected
    top1_seeded = [
        SampleRequest(SamplingParams(temperature=0.7, top_k=1, seed=9), n) for n in range(6)
    ]
    assert Sampler(2)(logits, top1_seeded) == expected


def test_top_p_keeps_the_minimal_nucleus() -> None:
    probs = [0.05, 0.5, 0.15, 0.3]  # sorted: token 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    row = logits_from_probs(probs).unsqueeze(0)
    cases = {0.45: {1}, 0.75: {1, 3}, 0.9: {1, 3, 2}, 1.0: {0, 1, 2, 3}}
    for top_p, nucleus in cases.items():
        seen = {
            Sampler(0)(row, [SampleRequest(SamplingParams(top_p=top_p, seed=s), 0)])[0]
            for s in range(400)
        }
        assert seen == nucleus, top_p


def test_top_k_keeps_k_most_likely() -> None:
    row = logits_from_probs([0.1, 0.2, 0.3, 0.4]).unsqueeze(0)
    seen = {
        Sampler(0)(row, [SampleRequest(SamplingParams(top_k=2, seed=s), 0)])[0] for s in range(300)
    }
    assert seen == {2, 3}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sharpens_or_flattens_exactly(temperature: float) -> None:
    row = torch.tensor([[0.0, 1.0]])
    n = 2000
    reqs = [SampleRequest(SamplingParams(temperature=temperature, seed=s), 0) for s in range(n)]
    picks = Sampler(0)(row.expand(n, 2), reqs)
    p_top = 1.0 / (1.0 + math.exp(-1.0 / temperature))
    # Inverse CDF over sorted probabilities: token 1 (the likelier) iff the draw < p_top.
    expected_top = sum(seeded_uniform(s, 0) < p_top for s in range(n))
    assert picks.count(1) == expected_top
    assert abs(expected_top / n - p_top) < 0.035  # and the draws are uniform enough


def test_seeded_draw_is_independent_of_batch_composition() -> None:
    gen = torch.Generator().manual_seed(3)
    target = torch.randn(1, 200, generator=gen)
    others = torch.randn(5, 200, generator=gen)
    mine = SampleRequest(SamplingParams(temperature=1.0, top_p=0.95, seed=1234), 7)
    alone = Sampler(0)(target, [mine])[0]
    mixed_reqs = [
        SampleRequest(SamplingParams(temperature=0.8), 0),
        SampleRequest(SamplingParams(temperature=0.0), 0),
        mine,
        SampleRequest(SamplingParams(temperature=1.2, seed=5), 3),
        SampleRequest(SamplingParams(top_k=5), 1),
        SampleRequest(SamplingParams(), 2),
    ]
    batch = torch.cat([others[:2], target, others[2:]])
    for engine_seed in (0, 99):
        assert Sampler(engine_seed)(batch, mixed_reqs)[2] == alone
    # The draw depends on the output index: over many indices the tokens are not all equal.
    tokens = {Sampler(0)(target, [SampleRequest(mine.params, n)])[0] for n in range(30)}
    assert len(tokens) > 5


def test_unseeded_rows_follow_the_engine_seed() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(8))
    reqs = [SampleRequest(SamplingParams(temperature=1.0), 0)] * 4
    a, b, c = Sampler(5), Sampler(5), Sampler(6)
    run_a = [a(logits, reqs) for _ in range(5)]
    assert run_a == [b(logits, reqs) for _ in range(5)]
    assert run_a != [c(logits, reqs) for _ in range(5)]


def test_sampler_does_not_mutate_and_checks_rows() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    Sampler(0)(logits, [SampleRequest(SamplingParams(top_k=3, top_p=0.5), 0)] * 2)
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="2 logits rows for 1 requests"):
        Sampler(0)(logits, [SampleRequest(SamplingParams(), 0)])
    assert Sampler(0)(torch.empty(0, 10), []) == []


def test_min_p_keeps_tokens_above_min_p_times_the_top() -> None:
    probs = [0.05, 0.5, 0.15, 0.3]  # min_p x 0.5 is the bar
    row = logits_from_probs(probs).unsqueeze(0)
    cases = {0.0: {0, 1, 2, 3}, 0.2: {1, 2, 3}, 0.5: {1, 3}, 0.7: {1}, 1.0: {1}}
    for min_p, kept in cases.items():
        seen = {
            Sampler(0)(row, [SampleRequest(SamplingParams(min_p=min_p, seed=s), 0)])[0]
            for s in range(400)
        }
        assert seen == kept, min_p


def test_min_p_applies_after_temperature_and_before_top_k_top_p() -> None:
    row = logits_from_probs([0.5, 0.3, 0.2]).unsqueeze(0)

    def seen(**kwargs: object) -> set[int]:
        reqs = [SampleRequest(SamplingParams(seed=s, **kwargs), 0) for s in range(300)]  # type: ignore[arg-type]
        return set(Sampler(0)(row.expand(len(reqs), 3), reqs))

    assert seen(min_p=0.5) == {0, 1}  # bar 0.25 on the raw distribution
    # T = 0.5 squares then renormalizes: 0.66, 0.24, 0.11; the bar is 0.33, only token 0.
    assert seen(min_p=0.5, temperature=0.5) == {0}
    # T = 2 flattens (0.42, 0.32, 0.26): all clear the bar of 0.21.
    assert seen(min_p=0.5, temperature=2.0) == {0, 1, 2}
    # Top-p acts on what min_p kept, renormalized (0.625, 0.375): 0.6 is reached by token 0
    # alone, where the raw 0.5 needs token 1 too.
    assert seen(top_p=0.6) == {0, 1}
    assert seen(min_p=0.5, top_p=0.6) == {0}
    assert seen(min_p=0.5, top_k=1) == {0}


def test_min_p_rows_leave_their_batch_neighbours_alone() -> None:
    logits = torch.randn(4, 60, generator=torch.Generator().manual_seed(4))
    hot = [SampleRequest(SamplingParams(temperature=8.0, seed=s), s) for s in range(4)]
    plain = Sampler(0)(logits, hot)
    mixed = [hot[0], SampleRequest(SamplingParams(temperature=8.0, seed=1, min_p=1.0), 1)]
    mixed += hot[2:]
    got = Sampler(0)(logits, mixed)
    assert got[1] == int(logits[1].argmax())  # min_p 1 at any temperature: the top token
    assert [got[0], *got[2:]] == [plain[0], *plain[2:]]
    assert plain[1] != got[1]  # and without it, temperature 8 wanders
