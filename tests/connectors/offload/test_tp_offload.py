"""The offload connector under tensor parallelism, on CPU (gloo, 2 ranks): outputs at TP=2 with
offload equal TP=1 without, and KV blocks stored as head slices (``kv_head_group: 1``) are
loaded, not recomputed, by an engine at the other degree, through LMDB; the ranks split the
machine's host and LMDB capacity."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from tests.engine.hf_models import make_tiny_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tp-offload"), "llama", seed=7)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tp-offload-qwen2"), "qwen2", seed=7)


def _llm(model_dir: str, tp: int, blocks: int, offload: dict | None = None) -> LLM:
    kw: dict[str, Any] = {}
    if offload is not None:
        kw = {"kv_offload": True, "kv_offload_config": offload}
    return LLM(
        model_dir,
        num_gpu_blocks=blocks,
        dtype="float32",
        device="cpu",
        tensor_parallel_size=tp,
        **kw,
    )


def _offload(tmp_path: Path, group: int = 0, host_blocks: int = 8) -> dict:
    return {
        "decision": "load",
        "calibrate": False,
        "kv_head_group": group,
        "tiers": [
            {"kind": "host", "capacity": f"{host_blocks * 20000}B"},
            {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"},
        ],
    }


def _prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


def _run(llm: LLM, rounds: list[list[list[int]]]) -> list[list[int]]:
    return [list(o.token_ids) for prompts in rounds for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_with_offload_equals_tp1_and_reloads(
    model_dir: str, qwen2_dir: str, tmp_path: Path, arch: str
) -> None:
    model_dir = qwen2_dir if arch == "qwen2" else model_dir
    # Two batches that cannot both stay in a 12-block pool, then the first again: its blocks
    # come back from the tiers (each rank its own slice).
    a, b = _prompts(1, 3, 40), _prompts(2, 3, 40)
    rounds = [a, b, a]
    with _llm(model_dir, 1, 12) as ref:
        want = _run(ref, rounds)
    with _llm(model_dir, 2, 12, _offload(tmp_path)) as llm:
        got = _run(llm, rounds)
        kv = llm.kv_stats()
    assert got == want
    assert kv["loaded_tokens"] > 0 and kv["failed_loads"] == 0, kv


@pytest.mark.parametrize("first,second", [(2, 1), (1, 2)])
def test_head_slices_stored_at_one_degree_load_at_another(
    model_dir: str, tmp_path: Path, first: int, second: int
) -> None:
    _exchange(model_dir, _offload(tmp_path, group=1), "lmdb", _prompts(3, 1, 70), first, second)


def test_the_idle_save_at_tp2_stores_every_ranks_slice(model_dir: str, tmp_path: Path) -> None:
    """An engine going idle saves the last request's blocks on every rank (``save_kv``: the
    copies issued, the seals not waited for); a fresh TP=1 engine then loads the whole prefix,
    which needs both ranks' head slices."""
    prompt = _prompts(4, 1, 70)
    config = _offload(tmp_path, group=1)
    with _llm(model_dir, 2, 16, config) as llm:
        engine = llm.engine
        engine.add_request("r", prompt[0], GREEDY)
        want: list[list[int]] = []
        while engine.has_unfinished_requests():
            want += [list(o.token_ids) for o in engine.step() if o.finished]
        before = llm.kv_stats()["saved_blocks"]  # the freed blocks wait for a next step
        engine.save_kv()
        assert llm.kv_stats()["saved_blocks"] >= before + 4
    with _llm(model_dir, 1, 16, config) as llm:
        got = _run(llm, [prompt])
        kv = llm.kv_stats()
    assert got == want
    assert kv["loaded_tokens"] == 64 and kv["recomputed_tokens"] == 0, kv


def _exchange(
    model_dir: str, config: dict, tier: str, prompt: list[list[int]], first: int, second: int
) -> None:
    """An engine at TP=``first`` computes ``prompt`` (4 full blocks) and stores its head
    slices; fresh engines (empty host tiers) at ``second`` and ``first`` load the whole prefix
    from ``tier``, every head slice of it, with the same greedy tokens."""
    with _llm(model_dir, first, 16, config) as llm:
        want = _run(llm, [prompt])
        assert llm.kv_stats()["loaded_tokens"] == 0
    for tp in (second, first):
        with _llm(model_dir, tp, 16, config) as llm:
            got = _run(llm, [prompt])
            kv = llm.kv_stats()
        assert got == want, f"TP={tp}"
        assert kv["loaded_tokens"] == 64 and kv["recomputed_tokens"] == 0, (tp, kv)
        assert kv["tiers"][tier]["hit_blocks"] > 0, kv


def test_keys_name_the_head_range_not_the_chain() -> None:
    from cachestore.hashing import Namespace, hash_request_tokens
    from connectors.offload.tp import head_groups, slice_namespace

    ns = Namespace(model_fingerprint="m")
    half = slice_namespace(ns, (1, 2), total=2)
    assert slice_namespace(ns, (0, 2), total=2) == ns  # all heads: today's keys
    assert (
        half.key_prefix() == f"{ns.store_prefix()}.h1-2"
        and half.store_prefix() == ns.store_prefix()
    )
    assert hash_request_tokens(half, list(range(32))) == hash_request_tokens(ns, list(range(32)))
    assert head_groups(8, 1, 2, 0) == [(4, 8)] and head_groups(8, 1, 2, 2) == [(4, 6), (6, 8)]
    with pytest.raises(ValueError, match="kv_head_group 3 does not divide the 4 KV heads"):
        head_groups(8, 0, 2, 3)


def test_a_load_counts_the_fewest_blocks_any_part_loaded() -> None:
    from connectors.offload.metadata import LoadResult
    from connectors.offload.tp import LoadMerger

    merger = LoadMerger(2)
    assert merger.merge([[LoadResult("r", 4, 4, 0.1)], []]) == ()  # rank 1 not done yet
    (done,) = merger.merge([[], [LoadResult("r", 3, 4, 0.2)]])
    assert (done.num_loaded_blocks, done.num_requested_blocks, done.seconds) == (3, 4, 0.2)
    merger.merge([[LoadResult("s", 2, 2, 0.1)], []])
    merger.forget(["s"])  # cancelled: a later load of "s" starts afresh
    assert merger.merge([[], [LoadResult("s", 2, 2, 0.1)]]) == ()


def test_a_bad_head_group_fails_the_engine_and_a_next_one_starts(
    model_dir: str, tmp_path: Path
) -> None:
    import gc

    from connectors.offload.config import ConfigError

    with pytest.raises(ConfigError, match="kv_head_group 3 does not divide the 1 KV heads"):
        _llm(model_dir, 2, 16, _offload(tmp_path, group=3))
    gc.collect()  # the failed engine's ranks and group go with it
    with _llm(model_dir, 2, 16, _offload(tmp_path)) as llm:
        assert len(_run(llm, [_prompts(4, 1, 20)])[0]) == GREEDY.max_tokens


@pytest.mark.parametrize("first,second", [(2, 1), (1, 2)])
def test_the_cache_server_serves_head_slices_to_either_degree(
    model_dir: str, tmp_path: Path, first: int, second: int
) -> None:
    """The same exchange through ``kvtier cache-server`` (a real daemon process): every rank of
    the storing engine puts its head slices there, and fresh engines at both degrees (their
    host tiers empty) load the whole prefix from it."""
    from tests.servers import cache_server_process

    with cache_server_process(tmp_path, "tok-tp-01", "tp") as port:
        remote = {"kind": "remote", "url": f"tcp://127.0.0.1:{port}", "token": "tok-tp-01"}
        config = {
            "decision": "load",
            "calibrate": False,
            "kv_head_group": 1,
            "tiers": [{"kind": "host", "capacity": f"{8 * 20000}B"}, {**remote, "timeout_s": 10}],
        }
        _exchange(model_dir, config, "remote", _prompts(4, 1, 70), first, second)


def test_the_ranks_of_a_machine_split_its_host_and_lmdb_capacity(
    model_dir: str, tmp_path: Path
) -> None:
    """At TP=2 the config's capacities are the machine's: each rank's host slab is half the
    host capacity and holds as many blocks as the TP=1 slab (its slices are half a block),
    and the LMDB directory both ranks write stays within the LMDB capacity, both ranks'
    slices together (before, each rank took the whole of both: twice the memory and disk,
    and past the map's size every write failed)."""
    lmdb_cap = 200_000
    config = _offload(tmp_path, host_blocks=12)
    config["tiers"][1]["capacity"] = f"{lmdb_cap}B"
    host_cap = 12 * 20000
    slots = {}
    for tp in (1, 2):
        with _llm(model_dir, tp, 16, config) as llm:
            host = llm.engine.kv_connector.store.tiers[0]  # rank 0's
            slots[tp] = host.num_slots
            assert host.usage().capacity_bytes <= host_cap // tp
            if tp == 2:
                # Ten 4-block prompts: 80 slices of ~4.2 kB, more than the LMDB capacity.
                for seed in range(10):
                    _run(llm, [_prompts(100 + seed, 1, 70)])
                llm.engine.flush_kv()
    assert slots[2] == slots[1], slots
    import lmdb

    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=2, readonly=True, lock=False)
    try:
        blocks = env.open_db(b"blocks", create=False)
        with env.begin(db=blocks) as txn:
            sizes = [len(v) for _, v in txn.cursor()]
            heads = {k.split(b"/")[0] for k, _ in txn.cursor()}
    finally:
        env.close()
    assert len(heads) == 2, heads  # both ranks' slices are there
    assert sum(sizes) <= lmdb_cap, (sum(sizes), lmdb_cap)


def test_the_share_of_a_tier_stack() -> None:
    from tiers.config import (
        HostTierConfig,
        LmdbTierConfig,
        RedisTierConfig,
        TierStackConfig,
        process_share,
    )

    stack = TierStackConfig(
        tiers=(
            HostTierConfig(capacity=48 << 30),
            LmdbTierConfig(path="/tmp/x", capacity=64 << 30),
            RedisTierConfig(capacity=8 << 30),
        )
    )
    assert process_share(stack, 1) is stack
    host, lmdb_cfg, redis = process_share(stack, 4).tiers
    assert isinstance(host, HostTierConfig) and host.capacity == 12 << 30
    # One directory, one count of every rank's bytes (tiers.lmdb); one server for Redis.
    assert lmdb_cfg == stack.tiers[1] and redis == stack.tiers[2]
