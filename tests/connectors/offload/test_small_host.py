"""A host tier smaller than the working set over LMDB (write-through, the default), users taking
turns as in the QA client: each user's next turn finds its history in LMDB, not in the host tier
(the others' saves evicted it). Later turns load from LMDB through the store's stage into the
host slab; every block the host tier evicts LMDB already holds (counted ``write_present``, none
written back or dropped: that the eviction copies nothing is
tests/cachestore/store/test_write_through.py's); outputs equal the engine without offload."""

from __future__ import annotations

import random
from pathlib import Path

from engine import LLM, SamplingParams
from tests.connectors.offload.test_connector import SLOT, VOCAB, make_llm

USERS, TURNS, HISTORY = 8, 3, 96
GEN = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def take_turns(llm: LLM) -> list[list[int]]:
    """Users one at a time (a pool for about one of them), each turn its history + reply + 12
    new tokens; every reply, turn-major."""
    rng = random.Random(11)
    histories = [[rng.randrange(3, VOCAB) for _ in range(HISTORY)] for _ in range(USERS)]
    replies: list[list[int]] = []
    for _ in range(TURNS):
        for h in histories:
            out = list(llm.generate([h], GEN)[0].token_ids)
            replies.append(out)
            h.extend(out)
            h.extend(rng.randrange(3, VOCAB) for _ in range(12))
    return replies


def test_a_small_host_tier_over_lmdb_serves_later_turns_from_lmdb(
    model_dir: str, tmp_path: Path
) -> None:
    want = take_turns(make_llm(model_dir, 16))
    config = {
        "decision": "load",
        "calibrate": False,
        "tiers": [  # 20 blocks: under 3 users' histories of 6-8 blocks each
            {"kind": "host", "capacity": f"{20 * SLOT}B"},
            {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"},
        ],
    }
    with make_llm(model_dir, 16, config) as llm:
        got = take_turns(llm)
        llm.engine.flush_kv()
        rows = {r["name"]: r for r in llm.kv_stats()["store"]["tiers"]}
        stats = llm.engine.stats()
    assert got == want
    host, lmdb = rows["host"], rows["lmdb"]
    assert lmdb["hits"] > 0 and stats["kv_loaded_tokens_total"] > 0  # later turns from LMDB
    assert host["evictions"] > 0
    # LMDB held every evicted block already (write-through): nothing copied down or dropped.
    assert lmdb["written_back"] == 0 and host["demotions_dropped"] == 0
    assert lmdb["write_present"] >= host["evictions"]


def test_blocks_reloaded_from_lmdb_are_not_saved_into_the_small_host_tier_again(
    model_dir: str, tmp_path: Path
) -> None:
    """The engine frees each reloaded history's blocks after the turn; LMDB holds them, and
    the host tier (about two histories) would evict them before that user's next turn. Once
    a window of such re-saves went out unread, they are no longer saved (the copies, the
    checksums, the evictions of fresher blocks), counted ``resave_bypassed``; every new block
    is still saved, and the outputs and loads are those of the engine without offload."""
    want = take_turns(make_llm(model_dir, 16))
    config = {
        "decision": "load",
        "calibrate": False,
        "tiers": [
            {"kind": "host", "capacity": f"{16 * SLOT}B"},
            {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"},
        ],
    }
    with make_llm(model_dir, 16, config) as llm:
        got = take_turns(llm)
        llm.engine.flush_kv()
        kv = llm.kv_stats()
    assert got == want
    rows = {r["name"]: r for r in kv["store"]["tiers"]}
    host, lmdb = rows["host"], rows["lmdb"]
    assert host["resave_bypassed"] > 0
    assert lmdb["written_through"] > 0 and kv["recomputed_tokens"] == 0
