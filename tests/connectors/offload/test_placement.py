"""``placement: worth_loading`` in the offload connector: with a cost model under which no
prefix would load from LMDB faster than it recomputes, the engine stops demoting into LMDB
(counted on it), outputs unchanged; with LMDB priced fast it is written as before. A bad value
is a one-line config error."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from cachestore.cost.model import TierCost
from cachestore.cost.online import default_priors
from connectors.offload import connector as offload_connector
from engine import SamplingParams
from tests.connectors.offload.test_connector import SLOT, VOCAB, make_llm
from tiers.config import ConfigError

GEN = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def config(lmdb: Path, placement: str) -> dict:
    return {
        "decision": "cost",
        "calibrate": False,
        "placement": placement,
        "tiers": [
            {"kind": "host", "capacity": f"{8 * SLOT}B"},
            {"kind": "lmdb", "path": str(lmdb), "capacity": "64MiB"},
        ],
    }


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, VOCAB) for _ in range(120)] for _ in range(4)]


def run(model_dir: str, cfg: dict) -> tuple[list[list[int]], dict]:
    with make_llm(model_dir, 16, cfg) as llm:
        outs = [list(o.token_ids) for o in llm.generate(prompts(), GEN)]
        llm.engine.flush_kv()
        rows = {r["name"]: r for r in llm.kv_stats()["store"]["tiers"]}
    return outs, rows


@pytest.mark.parametrize("lmdb_bps", [1e6, 1e12])
def test_lmdb_is_skipped_only_when_no_prefix_would_load_from_it(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lmdb_bps: float
) -> None:
    base = default_priors("cpu")
    costs = {**base.tier_costs, "lmdb": TierCost("lmdb", 1e-4, lmdb_bps)}

    def priors(kind: str):  # type: ignore[no-untyped-def]
        return dataclasses.replace(base, tier_costs=costs)

    monkeypatch.setattr(offload_connector, "default_priors", priors)
    want, _ = run(model_dir, config(tmp_path / "plain", "all"))
    outs, rows = run(model_dir, config(tmp_path / "placed", "worth_loading"))
    assert outs == want
    evicted = rows["host"]["evictions"]
    assert evicted > 0  # 4 x 7 blocks through an 8-block host tier
    written = rows["lmdb"]["written_through"] + rows["lmdb"]["written_back"]
    if lmdb_bps < 1e9:  # 1 MB/s: a whole-pool prefix loads in seconds, recomputes in ms
        assert rows["lmdb"]["placement_skipped"] >= evicted
        assert written == 0
    else:
        assert rows["lmdb"]["placement_skipped"] == 0
        assert written > 0


def test_a_bad_placement_is_a_config_error(model_dir: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="placement 'sometimes'"):
        make_llm(model_dir, 16, config(tmp_path / "db", "sometimes"))
