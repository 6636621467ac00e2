"""Admission under a full pool: a request that cannot be admitted costs the step nothing.

Eight 300-token histories are offloaded to a host tier, then all eight come back at once
through a 40-block pool that holds two of them: the head of the queue waits for blocks many
steps in a row. It must not be hashed, matched and looked up in the tiers on each of them:
the host tier is asked about each block at most twice per block it loads, and the outputs
equal those of an engine without offload."""

from __future__ import annotations

import random

from engine import SamplingParams
from tests.connectors.offload.test_connector import SLOT, VOCAB, make_llm

GEN = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def histories(n: int = 8, length: int = 300) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(n)]


def offload() -> dict:
    return {
        "decision": "load",
        "calibrate": False,
        "tiers": [{"kind": "host", "capacity": f"{256 * SLOT}B"}],
    }


def test_eight_queued_reloads_look_each_block_up_at_most_twice(model_dir: str) -> None:
    prompts = histories()
    with make_llm(model_dir, 40) as plain:
        reference = [list(o.token_ids) for o in plain.generate(prompts, GEN)]
    with make_llm(model_dir, 40, offload()) as llm:
        first = [list(o.token_ids) for o in llm.generate(prompts, GEN)]
        llm.engine.offload.flush()  # type: ignore[union-attr]
        before = llm.kv_stats()
        again = [list(o.token_ids) for o in llm.generate(prompts, GEN)]
        after = llm.kv_stats()
        sched = llm.engine.scheduler.stats
    assert first == reference and again == reference
    loaded = after["loaded_blocks"] - before["loaded_blocks"]
    looked_up = after["lookup_blocks"] - before["lookup_blocks"]
    assert loaded >= 8 * 15  # most of every history came back from the host tier
    assert looked_up <= 2 * loaded, (looked_up, loaded)
    assert sched.num_blocked_skips > 0  # the head did wait for blocks, cheaply


def test_a_blocked_head_is_not_looked_up_again_until_blocks_are_freed(model_dir: str) -> None:
    """Step by step: while the head waits for blocks, neither the GPU prefix cache nor the
    connector is asked about it again; once a running request finishes it is."""
    prompts = histories(3)
    with make_llm(model_dir, 40, offload()) as llm:
        llm.generate(prompts, GEN)
        llm.engine.offload.flush()  # type: ignore[union-attr]
        engine = llm.engine
        base = llm.kv_stats()["num_lookups"]
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, GEN)
        lookups: list[int] = []
        blocked: list[int] = []
        while engine.has_unfinished_requests():
            engine.step()
            lookups.append(llm.kv_stats()["num_lookups"] - base)
            blocked.append(engine.scheduler.stats.num_blocked_skips)
    # r2 waited for blocks for several steps, yet each request was looked up once.
    assert blocked[-1] >= 3, blocked
    assert lookups[-1] == 3, lookups


def test_every_request_that_finds_blocks_below_gets_exactly_one_decision(
    model_dir: str, tmp_path
) -> None:
    """Twenty 288-token prompts stored in LMDB by a first engine, whose 64-slot host tier
    takes more saves in a step than it has free slots (the overflow must go down to LMDB, not
    away); a fresh engine gets all twenty at once through a pool that holds a few: each request
    is decided once, and every one of the 20 x 18 blocks is loaded."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(289)] for _ in range(20)]
    config = {
        "decision": "load",
        "calibrate": False,
        "prefetch": False,
        "tiers": [
            {"kind": "host", "capacity": f"{64 * SLOT}B"},
            {
                "kind": "lmdb",
                "path": str(tmp_path / "db"),
                "capacity": "64MiB",
                "write_policy": "write_through",
            },
        ],
    }
    with make_llm(model_dir, 80, config) as first:
        reference = [list(o.token_ids) for o in first.generate(prompts, GEN)]
    with make_llm(model_dir, 80, config) as llm:
        again = [list(o.token_ids) for o in llm.generate(prompts, GEN)]
        kv = llm.kv_stats()
    assert again == reference
    assert kv["decisions"] == {"load_prefix": 20 + kv["cancelled_loads"]}
    assert kv["loaded_tokens"] == 20 * 18 * 16 and kv["recomputed_tokens"] == 0
