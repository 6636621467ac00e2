"""/metrics of the real server (uvicorn, the engine core in its own process as ``kvtier serve``
runs it, the tiny random llama) without and with ``--kv-offload``: the same families with the
same types in both modes, exactly the declared ones (engine.server.metric_families), counters
ending in ``_total``, and values that match what was sent. Offload: a 24-block GPU pool and
five 100-token prompts evict the first prompt's 6 full blocks to the host tier; sending it
again loads them back (as tests/engine/test_core_proc.py does). The offload server also runs
with ``vllm_metric_names`` (``--vllm-metric-names``): vLLM's names beside ours."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.client import CoreProcConfig, EngineCoreClient
from engine.server.metric_families import ALL_FAMILIES, SNAPSHOT_FAMILIES, VLLM_NAMES
from engine.server.metrics import ServerMetrics
from engine.ttft import ALL_PHASES
from tests.engine.hf_models import make_tiny_model
from tests.engine.test_server import run_server

pytestmark = pytest.mark.timeout(120)
MODEL = "m"
PROMPTS = [[1, *range(10 + 90 * i, 109 + 90 * i)] for i in range(5)]  # 100 tokens each
SENT = [*PROMPTS, PROMPTS[0]]
MAX_TOKENS = 4
OFFLOAD = {"decision": "load", "tiers": [{"kind": "host", "capacity": "8MiB"}]}

Families = dict[str, tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]]


def _parse(text: str) -> Families:
    """family name -> (type, {(sample name, sorted labels without model_name): value})."""
    out: Families = {}
    for family in text_string_to_metric_families(text):
        samples = {}
        for s in family.samples:
            assert s.labels.pop("model_name") == MODEL, s
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        out[family.name] = (family.type, samples)
    return out


def _value(families: Families, sample: str, **labels: str) -> float:
    """The value of one sample, whichever family carries it (KeyError if none does)."""
    key = (sample, tuple(sorted(labels.items())))
    (value,) = [samples[key] for _, samples in families.values() if key in samples]
    return value


def _scrape(model_dir: str, kv_offload: bool) -> Families:
    config = EngineConfig(
        model=model_dir,
        device="cpu",
        cache=CacheConfig(num_gpu_blocks=24),
        scheduler=SchedulerConfig(max_model_len=128),
    )
    if kv_offload:
        config = replace(config, kv_offload=True, kv_offload_config=OFFLOAD)
    engine = EngineCoreClient.start(config, CoreProcConfig(num_threads=1))
    try:
        with run_server(engine, MODEL, vllm_metric_names=kv_offload) as url:
            for prompt in SENT:
                body = {
                    "model": MODEL,
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "ignore_eos": True,
                }
                assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
            text = httpx.get(f"{url}/metrics").text
    finally:
        engine.shutdown()
    return _parse(text)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Families]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("metrics"), "llama", seed=5)
    return {mode: _scrape(model_dir, mode) for mode in (False, True)}


def _declared() -> dict[str, str]:
    # The parser names a counter family without its _total.
    return {f.name.removesuffix("_total"): f.kind for f in ALL_FAMILIES}


def _ours(families: Families) -> Families:
    return {n: f for n, f in families.items() if not n.startswith("vllm:")}


def test_both_modes_expose_exactly_the_declared_families_and_types(scraped) -> None:
    plain, offload = ({n: t for n, (t, _) in _ours(scraped[m]).items()} for m in (False, True))
    assert plain == offload
    assert plain == _declared()
    for families in scraped.values():
        for name, (kind, samples) in families.items():
            if kind == "counter":
                assert all(s.endswith("_total") for s, _ in samples), name


def test_vllm_names_carry_the_same_samples_as_ours_only_when_asked(scraped) -> None:
    """``--vllm-metric-names``: each family of ``VLLM_NAMES`` again under vLLM's name, the same
    type and samples (a router reading ``vllm:num_requests_running`` sees ours); without the
    flag, no ``vllm:`` family."""
    plain, offload = scraped[False], scraped[True]
    assert not [n for n in plain if n.startswith("vllm:")]
    theirs = {n: f for n, f in offload.items() if n.startswith("vllm:")}
    assert set(theirs) == {v.removesuffix("_total") for v in VLLM_NAMES.values()}
    for ours, vllm in VLLM_NAMES.items():
        kind, samples = offload[ours.removesuffix("_total")]
        base_ours, base_theirs = ours.removesuffix("_total"), vllm.removesuffix("_total")
        renamed = {(base_theirs + s[len(base_ours) :], lb): v for (s, lb), v in samples.items()}
        assert theirs[base_theirs] == (kind, renamed), vllm
        assert renamed, vllm
    assert _value(offload, "vllm:external_prefix_cache_hits_total") == 6 * 16
    assert _value(offload, "vllm:request_success_total", finished_reason="length") == len(SENT)


def test_values_match_what_was_sent(scraped) -> None:
    sent_tokens = sum(len(p) for p in SENT)
    for f in scraped.values():
        assert _value(f, "kvtier_prompt_tokens_total") == sent_tokens
        assert _value(f, "kvtier_generation_tokens_total") == len(SENT) * MAX_TOKENS
        assert _value(f, "kvtier_request_success_total", finished_reason="length") == len(SENT)
        assert _value(f, "kvtier_request_success_total", finished_reason="stop") == 0
        assert _value(f, "kvtier_request_prompt_tokens_sum") == sent_tokens
        assert _value(f, "kvtier_e2e_request_latency_seconds_count") == len(SENT)
        # every request had MAX_TOKENS tokens: a decode time each, over MAX_TOKENS - 1 tokens
        assert _value(f, "kvtier_request_decode_time_seconds_count") == len(SENT)
        decode = _value(f, "kvtier_request_decode_time_seconds_sum")
        tpot = _value(f, "kvtier_request_time_per_output_token_seconds_sum")
        assert decode > 0 and tpot == pytest.approx(decode / (MAX_TOKENS - 1))
        assert decode < _value(f, "kvtier_e2e_request_latency_seconds_sum")
        # vLLM's split of a request by the core's stamps: queue + prefill is the core's part of
        # the TTFT, inference its prefill and decode
        for name in ("queue", "prefill", "inference"):
            assert _value(f, f"kvtier_request_{name}_time_seconds_count") == len(SENT), name
        queue = _value(f, "kvtier_request_queue_time_seconds_sum")
        prefill = _value(f, "kvtier_request_prefill_time_seconds_sum")
        inference = _value(f, "kvtier_request_inference_time_seconds_sum")
        core_ttft = sum(
            _value(f, "kvtier_request_ttft_phase_seconds_sum", phase=p)
            for p in (
                "queue",
                "schedule",
                "load",
                "prefill_wait",
                "prefill_compute",
                "first_sample",
            )
        )
        assert 0 < prefill and queue + prefill == pytest.approx(core_ttft, rel=0.05)
        assert prefill < inference < _value(f, "kvtier_e2e_request_latency_seconds_sum")
        assert _value(f, "kvtier_requests_total", endpoint="/v1/completions", status="200") == len(
            SENT
        )
        for phase in ALL_PHASES:
            assert _value(f, "kvtier_request_ttft_phase_seconds_count", phase=phase) == len(SENT)
        assert _value(f, "kvtier_gpu_cache_blocks") == 24
        assert _value(f, "kvtier_num_requests_running") == 0
        assert _value(f, "kvtier_prompt_tokens_cached_by_tier_total", tier="gpu") == _value(
            f, "kvtier_prefix_cache_hits_total"
        )


def test_offload_counters_are_zero_without_offload_and_count_the_reload_with_it(scraped) -> None:
    plain, offload = scraped[False], scraped[True]
    assert _value(plain, "kvtier_kv_offload_enabled") == 0
    assert _value(offload, "kvtier_kv_offload_enabled") == 1
    assert _value(plain, "kvtier_kv_loaded_tokens_total") == 0
    assert _value(offload, "kvtier_kv_loaded_tokens_total") == 6 * 16
    for fam in (
        "kvtier_kv_tier_hits",
        "kvtier_kv_tier_read_seconds",
        "kvtier_kv_cost_model_tier_latency_seconds",
    ):
        assert plain[fam][1] == {}  # per-tier families: no tier, no sample
    host = {"tier": "host"}
    assert _value(offload, "kvtier_kv_tier_hits_total", **host) == 6
    assert _value(offload, "kvtier_prompt_tokens_cached_by_tier_total", **host) == 6 * 16
    reads = _value(offload, "kvtier_kv_tier_read_seconds_count", **host)
    assert reads >= 1
    assert _value(offload, "kvtier_kv_tier_read_seconds_bucket", le="+Inf", **host) == reads
    assert _value(offload, "kvtier_kv_load_seconds_count") == 1
    assert _value(offload, "kvtier_kv_saved_bytes_total") > 0
    for mode, families in scraped.items():
        decisions = {
            dict(lb)["decision"]: val for (_, lb), val in families["kvtier_kv_decisions"][1].items()
        }
        assert decisions == {"recompute": 0, "overlap": 0, "load_prefix": int(mode)}


def test_an_empty_snapshot_still_exports_every_family_and_unknown_keys_are_dropped() -> None:
    """A front end whose engine reports nothing yet (or only keys no family covers) still
    exposes the whole schema: unlabelled families read 0, labelled ones have no sample."""
    for stats in ({}, {"some_new_key_total": 7, "kv": {"odd": {"x": 1}}}):
        families = _parse(ServerMetrics(lambda s=stats: s, MODEL).exposition().decode())
        assert {n: t for n, (t, _) in families.items()} == _declared()
        assert not any("some_new_key" in n or "odd" in n for n in families)
        for f in SNAPSHOT_FAMILIES:
            samples = families[f.name.removesuffix("_total")][1]
            if not f.labels and f.kind in ("counter", "gauge"):
                assert list(samples.values()) == [0.0], f.name


def test_outcome_ratios_are_exported_by_decision() -> None:
    """The cost model's measured-over-priced ratio of each strategy served so far, labelled
    by decision; a strategy never served has no sample."""
    stats = {"kv": {"cost_model": {"outcome_ratios": {"overlap": {"all": 1.8, "8": 1.9}}}}}
    families = _parse(ServerMetrics(lambda: stats, MODEL).exposition().decode())
    samples = families["kvtier_kv_cost_model_outcome_ratio"][1]
    assert samples == {("kvtier_kv_cost_model_outcome_ratio", (("decision", "overlap"),)): 1.8}


def test_first_text_waits_for_the_first_output_that_carries_text() -> None:
    """``first_text`` is the core's first token to the first output with text (what a client
    that skips empty chunks sees), ``return`` to the first output: a first token that
    detokenizes to nothing leaves ``return`` alone and moves ``first_text`` one output on."""
    from engine.outputs import RequestMetrics, RequestOutput
    from engine.server.metrics import RequestTimer

    metrics = ServerMetrics(lambda: {}, MODEL)
    m = RequestMetrics(arrival_time=10.0, first_token_time=10.5, ttft_breakdown={"queue": 0.1})
    timer = RequestTimer(metrics, 10.0)
    for now, text in ((10.52, ""), (10.57, "a"), (10.6, "b")):
        timer.on_output(RequestOutput("r", [1], new_text=text, metrics=m), now)
    families = _parse(metrics.exposition().decode())

    def total(phase: str) -> float:
        return _value(families, "kvtier_request_ttft_phase_seconds_sum", phase=phase)

    assert total("return") == pytest.approx(0.02)
    assert total("first_text") == pytest.approx(0.07)
    assert total("queue") == pytest.approx(0.1)
