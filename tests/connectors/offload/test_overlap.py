"""Cake-style overlap end to end: compute the head while the tail loads, then skip the tail.
Outputs stay token-identical to the no-offload engine; kv_stats() counts both parts."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from cachestore.cost import outcomes
from cachestore.cost.model import PrefillCost, TierCost
from cachestore.cost.online import OnlineCostModel
from connectors.offload import scheduler as offload_scheduler
from engine import SamplingParams
from tests.connectors.offload.test_connector import (
    SLOT,
    VOCAB,
    host_lmdb,
    make_llm,
    run_conversations,
)


def _freeze_prices(llm: Any, scale: float = 1.0) -> None:
    """The engine's cost model replaced by fixed prices (alpha ~ 0): 1.5 ms to load a block
    from the host tier, 1 ms to compute one (16 tokens); both times ``scale``."""
    offload = llm.engine.offload
    assert offload is not None
    model = OnlineCostModel(
        {"host": TierCost("host", 0.0, 8192 / (1.5e-3 * scale))},
        PrefillCost(0.0, 1e-3 * scale / 16, 0.0),
        block_bytes=8192,
        block_tokens=16,
        alpha=1e-12,
    )
    offload.cost_model = offload.scheduler.cost_model = offload.worker.cost_model = model


def test_forced_overlap_keeps_outputs_identical(model_dir: str, tmp_path: Path) -> None:
    reference = run_conversations(make_llm(model_dir, 24), turns=3)
    config = {**host_lmdb(tmp_path), "decision": "overlap", "calibrate": False}
    with make_llm(model_dir, 24, config) as llm:
        assert run_conversations(llm, turns=3) == reference
        kv = llm.kv_stats()
    assert kv["decisions"]["overlap"] > 0 and kv["num_overlaps"] > 0
    assert kv["overlap_head_tokens"] > 0 and kv["loaded_tokens"] > 0
    assert kv["failed_loads"] == 0
    assert kv["recomputed_tokens"] >= kv["overlap_head_tokens"]


P_TOKENS = 85


def _reload_p_after_q(
    model_dir: str, tmp_path: Path, reloads: int, scale: float = 1.0
) -> tuple[dict, dict, list[dict], dict[str, int]]:
    """P (85 tokens) once, then ``reloads`` times Q (120 tokens: evicts P's last three blocks
    to the host tier) and P again, each P's tokens those of an engine without offload, under
    ``_freeze_prices(scale)``: (kv stats, the cost model's snapshot, the request log's rows,
    the last P's cached tokens by tier)."""
    rng = random.Random(2)
    p = [rng.randrange(3, VOCAB) for _ in range(P_TOKENS)]
    q = [rng.randrange(3, VOCAB) for _ in range(120)]
    one = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    reference = make_llm(model_dir, 10).generate([p], one)[0].token_ids
    log_path = tmp_path / "requests.jsonl"
    config = {"calibrate": False, "tiers": [{"kind": "host", "capacity": f"{64 * SLOT}B"}]}
    with make_llm(model_dir, 10, config, request_log=str(log_path)) as llm:
        _freeze_prices(llm, scale)
        assert llm.generate([p], one)[0].token_ids == reference
        for _ in range(reloads):
            llm.generate([q], one)
            [out] = llm.generate([p], one)
            assert out.token_ids == reference
        kv = llm.kv_stats()
        snapshot = llm.engine.offload.cost_model.snapshot()
    rows = [json.loads(line) for line in log_path.read_text().splitlines()]
    return kv, snapshot, rows, out.num_cached_tokens_by_tier


def test_cost_model_picks_overlap_and_the_engine_executes_it(
    model_dir: str, tmp_path: Path
) -> None:
    """P (85 tokens) is evicted to the host tier by Q as in test_offload's exact scenario: P
    again has 2 GPU blocks and 3 host blocks. Prices: 1.5 ms per block to load, 1 ms to
    compute, frozen (alpha ~ 0). load all: 4.5 + 0.3 ms; recompute: 3.3 ms; overlap m=1:
    max(1, 3) + 0.3; m=2: max(2, 1.5) + 0.3 ms: the head (2 blocks) is computed while the tail
    (1 block) loads. (Equal load and compute prices tie m=1 with m=2, and the live prefill
    scale, which moves by 1e-12 with the machine's load, broke the tie either way.)"""
    kv, _, rows, by_tier = _reload_p_after_q(model_dir, tmp_path, reloads=1)
    assert kv["decisions"] == {"overlap": 1} and kv["num_overlaps"] == 1
    assert kv["gpu_hit_tokens"] == 32
    assert kv["overlap_head_tokens"] == 32 and kv["loaded_tokens"] == 16
    assert kv["recomputed_tokens"] == 32 and kv["loaded_blocks"] == 1
    assert kv["tiers"]["host"]["hit_blocks"] == 1 and kv["failed_loads"] == 0
    assert rows[-1]["decision"] == "overlap" and rows[-1]["hit_tiers"] == ["gpu", "gpu"]
    # the API's cached tokens: the GPU hit and the tail loaded from the host tier (the
    # computed head is not cached)
    assert by_tier == {"gpu": 32, "host": 16}


def test_outcome_ratios_reach_the_engines_decisions_within_their_span(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scenario and prices of the test above, 100x smaller: the overlap is priced at 23 us,
    recompute at 33 us and loading all of it at 48 us. On CPU every plan takes far longer than
    that (a sample is clamped at 4x its price): the first reload of P takes the overlap and
    measures 4x, Q's recompute 4x too. The next reload of P takes load-all, never measured
    (ratio 1) and priced 2.1x the cheapest, within ``OUTCOME_SPAN`` (2.5): the ratios reach the
    engine's decision. With the span at 1.5 it stays out and the overlap is kept: a plan priced
    far above is not taken on the others' inflated ratios. Tokens unchanged."""
    for span, second in ((outcomes.OUTCOME_SPAN, "load_prefix"), (1.5, "overlap")):
        monkeypatch.setattr(outcomes, "OUTCOME_SPAN", span)
        run_dir = tmp_path / f"span{span}"
        run_dir.mkdir()
        _, snapshot, rows, _ = _reload_p_after_q(model_dir, run_dir, reloads=2, scale=0.01)
        ratios = snapshot["outcome_ratios"]
        reloads = [r for r in rows if r["prompt_tokens"] == P_TOKENS][1:]
        assert [r["decision"] for r in reloads] == ["overlap", second]
        assert reloads[0]["kv_plan"]["predicted_s"] == pytest.approx(23e-6, rel=0.01)
        assert ratios["overlap"]["all"] == 4.0
        # load-all is measured only once it is taken
        assert ("load_prefix" in ratios) == (second == "load_prefix")


def test_a_reload_that_shared_its_step_is_measured_against_the_step_it_ran_in(
    model_dir: str, tmp_path: Path
) -> None:
    """P reloaded together with a fresh 30-token prompt R: P's few new tokens compute in R's
    step. Its outcome is taught (counted as shared) against its plan's price plus the prefill
    model's price of R's 30 tokens, not against its own price alone: the ratio the cost model
    keeps is the one the request log's phases give with R's share priced in, and differs from
    the one without it (prices: 0.3 ms a token, so R's share is 9 ms and P's own ~1.6 ms)."""
    rng = random.Random(2)
    p = [rng.randrange(3, VOCAB) for _ in range(P_TOKENS)]
    q = [rng.randrange(3, VOCAB) for _ in range(120)]
    r = [rng.randrange(3, VOCAB) for _ in range(30)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    log_path = tmp_path / "requests.jsonl"
    config = {"calibrate": False, "tiers": [{"kind": "host", "capacity": f"{64 * SLOT}B"}]}
    with make_llm(model_dir, 10, config, request_log=str(log_path)) as llm:
        offload = llm.engine.offload
        assert offload is not None
        model = OnlineCostModel(  # fixed prices: a host block loads far faster than computed
            {"host": TierCost("host", 0.0, 8192 / 1e-4)},
            PrefillCost(0.0, 3e-4, 0.0),
            block_bytes=8192,
            block_tokens=16,
            alpha=1e-12,
        )
        offload.cost_model = offload.scheduler.cost_model = offload.worker.cost_model = model
        llm.generate([p], one)
        llm.generate([q], one)  # P's last blocks go to the host tier
        llm.generate([p, r], one)  # P's reload computes in R's step
        kv = llm.kv_stats()
    assert kv["loaded_tokens"] > 0 and kv["shared_step_outcomes"] == 1
    rows = [json.loads(line) for line in log_path.read_text().splitlines()]
    [row] = [x for x in rows[2:] if x["prompt_tokens"] == P_TOKENS]
    plan, phases = row["kv_plan"], row["ttft_breakdown_s"]
    assert row["decision"] == "load_prefix"
    others = row["prefill_step_tokens"] - plan["recompute_tokens"]
    assert others == len(r)
    measured = sum(phases[k] for k in ("load", "prefill_wait", "prefill_compute"))
    share = others * 3e-4

    def clamped(x: float) -> float:
        return min(max(x, 1 / outcomes.RATIO_CLAMP), outcomes.RATIO_CLAMP)

    with_share = clamped(measured / (plan["predicted_s"] + share))
    assert with_share != pytest.approx(clamped(measured / plan["predicted_s"]), rel=0.05)
    learned = model.snapshot()["outcome_ratios"]["load_prefix"]["all"]
    # the log's phases are rounded to 0.1 us; the snapshot's ratio to 4 decimals
    assert learned == pytest.approx(with_share, rel=0.01, abs=2e-4)


@pytest.mark.parametrize(
    ("threshold", "busy", "decision"),
    [(40, True, "recompute"), (40, False, "overlap"), (10_000, True, "overlap")],
)
def test_cost_offers_no_overlap_while_other_prompts_share_the_step(
    model_dir: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    threshold: int,
    busy: bool,
    decision: str,
) -> None:
    """The prices of the test above; P (85 tokens) sits in the host tier only. L (240 tokens)
    is prefilled 64 tokens a step. When P arrives while L is mid-prefill (busy) and L's
    unfinished chunk counts as a shared step (threshold 40 < 64), P's head would be computed
    beside L's next chunks: ``cost`` prices no overlap and recomputes (5.3 ms, under loading all:
    7.8 ms). When P arrives after L finished (the engine idle, though L's last chunk of 48 was
    above the threshold too), or with the threshold above L's chunks, the same P takes the
    overlap (3.3 ms). Tokens as without offload either way."""
    monkeypatch.setattr(offload_scheduler, "SHARED_STEP_TOKENS", threshold)
    rng = random.Random(2)
    p = [rng.randrange(3, VOCAB) for _ in range(85)]
    long = [rng.randrange(3, VOCAB) for _ in range(240)]  # chunks of 64, 64, 64, 48
    three = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    reference = make_llm(model_dir, 40).generate([p], three)[0].token_ids
    config = {"calibrate": False, "tiers": [{"kind": "host", "capacity": f"{64 * SLOT}B"}]}
    with make_llm(model_dir, 40, config, max_num_batched_tokens=64) as llm:
        _freeze_prices(llm)
        engine = llm.engine
        assert llm.generate([p], three)[0].token_ids == reference
        engine.flush_kv()
        assert engine.pool.reset_prefix_cache()  # P in the host tier only
        engine.add_request("l", long, one)
        assert engine.step() == []  # L's first chunk: its prefill goes on
        if not busy:
            while engine.has_unfinished_requests():
                engine.step()
        engine.add_request("p", p, three)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.req_id == "p":
                    tokens = list(out.token_ids)
        kv = llm.kv_stats()
    assert tokens == reference
    assert kv["decisions"] == {decision: 1}
    assert kv["num_overlaps"] == int(decision == "overlap")
    assert kv["shared_step_decisions"] == int(decision == "recompute")
