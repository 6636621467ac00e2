"""Start-up calibration of ``--kv-offload``: prefill through the real runner, the tiers and the
host hop are measured, the priors replaced, kv_stats() reports them, and nothing is left behind
(scratch blocks zeroed, no calibration keys in the tiers, outputs unchanged)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachestore.cost.online import default_priors
from connectors.offload.calibration import prefill_sizes
from connectors.offload.config import parse_offload_config
from tests.connectors.offload.test_connector import GREEDY, VOCAB, make_llm
from tiers.config import ConfigError


def tiers(tmp_path: Path) -> list[dict]:
    return [
        {"kind": "host", "capacity": "1MiB"},
        {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"},
    ]


def test_calibration_replaces_the_priors_and_cleans_up(
    model_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = [(7 * i) % (VOCAB - 3) + 3 for i in range(50)]
    reference = make_llm(model_dir, 24).generate([prompt], GREEDY)[0].token_ids
    with make_llm(model_dir, 24, {"decision": "load", "tiers": tiers(tmp_path)}) as llm:
        # The progress bars draw only on a terminal: captured stderr (a pipe, a log file) gets
        # no carriage-return bars.
        assert "calibrate prefill" not in capsys.readouterr().err
        offload = llm.engine.offload
        assert offload is not None
        assert bool((llm.engine.runner.kv_cache.tensor == 0).all())  # scratch blocks zeroed
        lmdb = offload.store.tiers[1]
        assert lmdb.usage().num_entries == 0  # calibration blocks deleted
        cost = llm.kv_stats()["cost_model"]
        assert llm.generate([prompt], GREEDY)[0].token_ids == reference
    cpu = default_priors("cpu")
    for name in ("host", "lmdb"):
        t = cost["tiers"][name]
        assert t["prior_bandwidth_bytes_per_s"] > 0 and t["prior_latency_s"] >= 0
        assert t["prior_bandwidth_bytes_per_s"] != cpu.tier_costs[name].bandwidth_bytes_per_s
    assert cost["tiers"]["redis"]["prior_bandwidth_bytes_per_s"] == 0.5e9  # not measured
    p = cost["prefill"]
    assert p["fixed_s"] + p["per_token_s"] + p["attention_s"] > 0
    assert min(p["fixed_s"], p["per_token_s"], p["attention_s"]) >= 0
    assert (p["fixed_s"], p["per_token_s"]) != (cpu.prefill.fixed_s, cpu.prefill.per_token_s)
    assert cost["block_bytes"] == 8192


def test_calibrate_false_keeps_the_default_priors(model_dir: str, tmp_path: Path) -> None:
    config = {"calibrate": False, "tiers": tiers(tmp_path)}
    with make_llm(model_dir, 24, config) as llm:
        cost = llm.kv_stats()["cost_model"]
    cpu = default_priors("cpu")
    assert (
        cost["tiers"]["host"]["bandwidth_bytes_per_s"]
        == cpu.tier_costs["host"].bandwidth_bytes_per_s
    )
    assert cost["prefill"]["fixed_s"] == cpu.prefill.fixed_s


def test_calibrate_knob_is_a_strict_bool() -> None:
    assert parse_offload_config({"tiers": [{"kind": "host", "capacity": "1MiB"}]}).calibrate
    config = parse_offload_config(
        {"calibrate": False, "tiers": [{"kind": "host", "capacity": "1MiB"}]}
    )
    assert config.calibrate is False
    with pytest.raises(ConfigError, match="calibrate must be true or false"):
        parse_offload_config({"calibrate": "yes", "tiers": [{"kind": "host", "capacity": "1MiB"}]})


def test_prefill_sizes_fit_the_engine() -> None:
    assert prefill_sizes(8192)[0] == (256, 0)  # the defaults fit
    assert prefill_sizes(256) == ((32, 0), (128, 0), (256, 0), (64, 192), (32, 224))
    assert all(n + c <= 100 for n, c in prefill_sizes(100))
    assert len(set(prefill_sizes(32))) >= 3
    with pytest.raises(ValueError, match="32 tokens"):
        prefill_sizes(31)
    # `kvtier serve`'s 2,048-token steps over a 1,200-block pool: new tokens within the
    # budget, contexts as long as the defaults'
    assert prefill_sizes(19200, 2048) == (
        (256, 0),
        (1024, 0),
        (2048, 0),
        (512, 3072),
        (256, 4096),
    )
    # a pool that leaves less room: contexts shrink to fit it, not under the scaled ones
    assert prefill_sizes(3000, 2048)[3:] == ((512, 2488), (256, 2744))
    assert prefill_sizes(2048, 2048) == prefill_sizes(2048)
    with pytest.raises(ValueError, match="32 tokens"):
        prefill_sizes(4096, 16)


def test_only_a_lone_chunk_that_samples_teaches_the_prefill_model(
    model_dir: str, tmp_path: Path
) -> None:
    """A 100-token prompt alone in 32-token steps: its first three chunks sample nothing (on
    CUDA such a step returns once its kernels are enqueued, so its wall time is not its
    compute), its last one samples: one prefill sample, not four. Then a 50-token prompt in one
    step: one more."""
    long = [(5 * i) % (VOCAB - 3) + 3 for i in range(100)]
    short = [(11 * i) % (VOCAB - 3) + 3 for i in range(50)]
    config = {"calibrate": False, "tiers": tiers(tmp_path)}
    with make_llm(model_dir, 24, config, max_num_batched_tokens=32) as llm:
        samples = lambda: llm.kv_stats()["cost_model"]["prefill"]["num_samples"]  # noqa: E731
        before = samples()
        llm.generate([long], GREEDY)
        assert samples() == before + 1
    with make_llm(model_dir, 24, config) as llm:
        before = samples()
        llm.generate([short], GREEDY)
        assert samples() == before + 1
