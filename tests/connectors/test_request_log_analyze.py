"""``--request-log`` end to end: the log an offloading engine writes is read back by
``kvtier analyze --format auto``, and the analysis agrees with what the engine did."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cachestore.analyze.cli import add_arguments, main
from tests.connectors.offload.test_connector import host_lmdb, make_llm, run_conversations


def test_request_log_is_analyzed_and_agrees_with_the_engine(model_dir: str, tmp_path: Path) -> None:
    log_path, out = tmp_path / "requests.jsonl", tmp_path / "analysis.json"
    config = {**host_lmdb(tmp_path, host_slots=64), "calibrate": False}
    with make_llm(model_dir, 24, config, request_log=str(log_path)) as llm:
        run_conversations(llm, turns=3)
    entries = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert len(entries) == 18

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [str(log_path), "--format", "auto", "--json", str(out), "--quiet", "--tier", "host=inf"]
    )
    assert main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["format"] == "request-log" and doc["block_tokens"] == 16
    assert doc["requests"] == 18
    assert doc["block_refs"] == sum(len(e["block_hashes"]) for e in entries)
    assert doc["unique_blocks"] == len({h for e in entries for h in e["block_hashes"]})
    # The analysis (unbounded tier) hits every leading block seen before; the engine, whose
    # tiers kept everything, hits the same blocks but the last token's block.
    seen: set[str] = set()
    sim_hits = engine_expected = 0
    for e in entries:
        hit = 0
        while hit < len(e["block_hashes"]) and e["block_hashes"][hit] in seen:
            hit += 1
        sim_hits += hit
        engine_expected += min(hit, (e["prompt_tokens"] - 1) // 16)
        seen.update(e["block_hashes"])
    assert doc["hit_blocks"] == sim_hits > 0
    assert sum(len(e["hit_tiers"]) for e in entries) == engine_expected
    assert {t for e in entries for t in e["hit_tiers"]} <= {"gpu", "host", "lmdb"}
