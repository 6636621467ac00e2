"""The connector contract and the offload connector's scheduler side, without a model: a real
block pool, a real host-tier store, exact metadata, pins and counters."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachestore.codec import BlockMeta, encode_block
from cachestore.cost.model import PrefillCost, TierCost
from cachestore.cost.online import OnlineCostModel, default_priors
from cachestore.hashing import BlockKey, Namespace, block_key, hash_request_tokens
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from connectors.offload.config import (
    default_offload_config,
    load_offload_config,
    mem_available_bytes,
)
from connectors.offload.metadata import (
    BlockLoad,
    BlockSave,
    KVConnectorMetadata,
    LoadResult,
    WorkerReport,
)
from connectors.offload.scheduler import OffloadScheduler
from connectors.offload.stats import OffloadStats
from engine.cache_dir import default_cache_dir
from engine.core_types import SchedulerOutput
from engine.kv_connector import ExternalHit
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.sched.block_pool import BlockPool
from tiers.config import ConfigError, HostTierConfig, LmdbTierConfig
from tiers.host import HostTier
from tiers.lmdb import LmdbTier

NS = Namespace(model_fingerprint="test-base")
META = BlockMeta(
    dtype="float32", shape=(2, 2, 16, 2, 16), layout="block_major_v1", namespace=NS.key_prefix()
)
PAYLOAD = bytes(META.payload_bytes)


@pytest.fixture
def store() -> Iterator[HierarchicalStore]:
    s = HierarchicalStore(
        [HostTier(64 * 9000, 9000, pin_memory=False)], StoreConfig(namespace=NS.key_prefix())
    )
    yield s
    s.close()


def make_side(store: HierarchicalStore, decision: str = "load") -> OffloadScheduler:
    priors = default_priors("cpu")
    model = OnlineCostModel(dict(priors.tier_costs), priors.prefill, META.payload_bytes, 16)
    return OffloadScheduler(store, NS, decision=decision, cost_model=model, stats=OffloadStats())


def request(n: int, req_id: str = "r") -> Request:
    r = Request(req_id, [3 + i % 400 for i in range(n)], SamplingParams(max_tokens=1))
    r.block_hashes = hash_request_tokens(NS, r.all_token_ids)
    return r


def store_blocks(store: HierarchicalStore, r: Request, num: int) -> list[str]:
    keys = [block_key(NS, h) for h in r.block_hashes[:num]]
    assert store.put_many([(k, encode_block(PAYLOAD, META)) for k in keys]) == num
    return keys


def test_metadata_is_frozen_and_loads_are_checked() -> None:
    meta = KVConnectorMetadata(saves=(BlockSave(3, "k"),))
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.saves = ()  # type: ignore[misc]
    with pytest.raises(ValueError, match="2 blocks for 1 keys"):
        BlockLoad("r", (1, 2), ("a",), 0)
    with pytest.raises(ValueError, match="0 blocks for 0 keys"):
        BlockLoad("r", (), (), 0)


def test_freed_blocks_become_saves_in_free_order_and_eviction_marks_reuse(
    store: HierarchicalStore,
) -> None:
    side = make_side(store)
    pool = BlockPool(4, 16, listener=side)
    blocks = pool.get_new_blocks(3)
    r = request(48)
    for b, h, i in zip(blocks, r.block_hashes, range(3), strict=True):
        pool.cache_full_block(b, h, r.all_token_ids[i * 16 : (i + 1) * 16])
    pool.free_blocks(reversed(blocks))
    empty = SchedulerOutput([], 0)
    meta = side.build_connector_meta(empty)
    assert meta.saves == tuple(BlockSave(b, block_key(NS, r.block_hashes[b])) for b in (2, 1, 0))
    assert not meta.saves_reuse_blocks and meta.num_scheduled_requests == 0
    assert side.build_connector_meta(empty) == KVConnectorMetadata()
    # Freed and evicted before the next step: still saved, and the forward must wait for it.
    pool.free_blocks([pool.get_new_blocks(1)[0]])  # block 3: no hash, not a save
    pool.touch([pool.blocks[2]])
    pool.free_blocks([pool.blocks[2]])
    pool.get_new_blocks(4)  # queue order 1, 0, 3, 2: block 2 is evicted last
    meta = side.build_connector_meta(empty)
    assert [s.block_id for s in meta.saves] == [2] and meta.saves_reuse_blocks


def test_matching_is_side_effect_free_and_follows_the_policy(store: HierarchicalStore) -> None:
    r = request(70)  # 4 full blocks; at most (70-1)//16 = 4 may load
    store_blocks(store, r, 3)
    load = make_side(store, "load")
    before = store.stats()
    assert load.get_num_new_matched_tokens(r, 16) == ExternalHit(32, load_async=True)
    assert load.get_num_new_matched_tokens(r, 16) == ExternalHit(32, load_async=True)
    after = store.stats()
    assert after["load_pins"] == 0 and after["in_flight_stores"] == 0
    assert after["tiers"][0]["bytes_written"] == before["tiers"][0]["bytes_written"]
    assert make_side(store, "recompute").get_num_new_matched_tokens(r, 0) == ExternalHit()
    # On the CPU priors a host block (8 KiB at 5 GB/s) is far cheaper than 16 tokens of prefill.
    assert make_side(store, "cost").get_num_new_matched_tokens(r, 0) == ExternalHit(48, True)
    assert load.get_num_new_matched_tokens(r, 48) == ExternalHit()  # block 3 is not stored


def test_load_lifecycle_pins_reports_and_cancels(store: HierarchicalStore) -> None:
    side = make_side(store)
    r = request(70)
    keys = store_blocks(store, r, 3)
    assert side.get_num_new_matched_tokens(r, 0) == ExternalHit(48, True)
    side.update_state_after_alloc(r, [7, 8, 9, 10, 11], 0, 48)
    assert store.stats()["load_pins"] == 3  # pinned until the worker's read completes
    meta = side.build_connector_meta(SchedulerOutput([], 0))
    assert meta.loads == (BlockLoad("r", (7, 8, 9), tuple(keys), 0, ("host",) * 3),)
    side.update_from_worker(WorkerReport((LoadResult("r", 2, 3, 0.01),)))
    assert side.get_finished_loading() == {"r": 32}
    assert side.get_finished_loading() == {}
    snap = side.stats.snapshot()
    assert snap["loaded_tokens"] == 32 and snap["recomputed_tokens"] == 16
    assert snap["decisions"] == {"load_prefix": 1} and snap["tiers"] == {"host": {"hit_blocks": 2}}
    assert r.kv_hit_tiers == ["host", "host"] and r.kv_decision == "load_prefix"
    # Aborted before its metadata went out: nothing reaches the worker, pins are undone here.
    r2 = request(70, "r2")
    side.get_num_new_matched_tokens(r2, 0)
    side.update_state_after_alloc(r2, [1, 2, 3, 4, 5], 0, 48)
    side.request_finished(r2, [1, 2, 3, 4, 5])
    assert side.build_connector_meta(SchedulerOutput([], 0)) == KVConnectorMetadata()
    # Aborted after: the worker is told to drop it.
    r3 = request(70, "r3")
    side.get_num_new_matched_tokens(r3, 0)
    side.update_state_after_alloc(r3, [1, 2, 3, 4, 5], 0, 48)
    side.build_connector_meta(SchedulerOutput([], 0))
    side.request_finished(r3, [1, 2, 3, 4, 5])
    assert side.build_connector_meta(SchedulerOutput([], 0)).cancelled_loads == {"r3"}
    side.update_from_worker(WorkerReport((LoadResult("r3", 3, 3, 0.01),)))
    assert side.get_finished_loading() == {}
    assert side.stats.snapshot()["cancelled_loads"] == 2


@pytest.fixture
def below(tmp_path: Path) -> Iterator[HierarchicalStore]:
    """A host tier over an LMDB tier."""
    s = HierarchicalStore(
        [HostTier(64 * 9000, 9000, pin_memory=False), LmdbTier(tmp_path / "lmdb", 64 << 20)],
        StoreConfig(namespace=NS.key_prefix()),
    )
    yield s
    s.close()


def other_request(n: int, req_id: str) -> Request:
    """A prompt of ``n`` tokens sharing no block with ``request``'s."""
    r = Request(req_id, [5 + i % 300 for i in range(n)], SamplingParams(max_tokens=1))
    r.block_hashes = hash_request_tokens(NS, r.all_token_ids)
    return r


def store_in_lmdb(store: HierarchicalStore, r: Request, num: int) -> list[BlockKey]:
    """The first ``num`` blocks of ``r``, written to the LMDB tier only."""
    keys = [block_key(NS, h) for h in r.block_hashes[:num]]
    store.tiers[1].put_many([(k, encode_block(PAYLOAD, META)) for k in keys])
    return keys


def backlog_gauge(side: OffloadScheduler) -> int:
    return int(side.stats.snapshot()["load_backlog_blocks"])


def test_the_load_backlog_holds_a_lower_tier_load_until_the_worker_reports_it(
    below: HierarchicalStore,
) -> None:
    side = make_side(below)
    r = request(70)
    keys = store_in_lmdb(below, r, 3)
    assert side.get_num_new_matched_tokens(r, 0) == ExternalHit(48, True)
    assert side.load_backlog() == {} and backlog_gauge(side) == 0  # decided, not started
    side.update_state_after_alloc(r, [7, 8, 9, 10, 11], 0, 48)
    assert side.load_backlog() == {"lmdb": 3} and backlog_gauge(side) == 3
    meta = side.build_connector_meta(SchedulerOutput([], 0))
    assert [(ld.keys, ld.source_tiers) for ld in meta.loads] == [(tuple(keys), ("lmdb",) * 3)]
    # A host-tier load is copied without the load thread: it adds nothing.
    h = other_request(40, "h")
    store_blocks(below, h, 2)
    assert side.get_num_new_matched_tokens(h, 0) == ExternalHit(32, True)
    side.update_state_after_alloc(h, [1, 2, 3], 0, 32)
    assert side.load_backlog() == {"lmdb": 3} and backlog_gauge(side) == 3
    # Reported (short, here: one block missing): the load left the thread.
    side.update_from_worker(WorkerReport((LoadResult("r", 2, 3, 0.01),)))
    assert side.load_backlog() == {} and backlog_gauge(side) == 0
    assert side.get_finished_loading() == {"r": 32}


def test_an_aborted_load_leaves_the_backlog_whether_or_not_it_was_sent(
    below: HierarchicalStore,
) -> None:
    side = make_side(below)
    r, r2 = request(70), request(70, "r2")
    store_in_lmdb(below, r, 3)
    # Sent to the worker, then aborted mid-load: out at once, before the worker drops it.
    side.get_num_new_matched_tokens(r, 0)
    side.update_state_after_alloc(r, [7, 8, 9, 10, 11], 0, 48)
    side.build_connector_meta(SchedulerOutput([], 0))
    assert side.load_backlog() == {"lmdb": 3}
    side.request_finished(r, [7, 8, 9, 10, 11])
    assert side.load_backlog() == {} and backlog_gauge(side) == 0
    assert side.build_connector_meta(SchedulerOutput([], 0)).cancelled_loads == {"r"}
    side.update_from_worker(WorkerReport((LoadResult("r", 3, 3, 0.01),)))  # the late report
    assert side.load_backlog() == {} and backlog_gauge(side) == 0
    # Aborted before its metadata went out.
    side.get_num_new_matched_tokens(r2, 0)
    side.update_state_after_alloc(r2, [1, 2, 3, 4, 5], 0, 48)
    assert backlog_gauge(side) == 3
    side.request_finished(r2, [1, 2, 3, 4, 5])
    assert side.load_backlog() == {} and backlog_gauge(side) == 0


def test_a_cost_decision_behind_a_backlog_recomputes_and_logs_it(
    below: HierarchicalStore,
) -> None:
    """LMDB at 0.2 ms a block, prefill 5 ms + 60 us a token. A 3-block reload of a 70-token
    prompt loads alone (0.6 + 6.3 ms against 9.2 ms); behind another request's 40 queued
    blocks (8 ms) it costs 14.9 ms, and recomputing wins."""
    lmdb_rate = META.payload_bytes / 2e-4
    model = OnlineCostModel(
        {"host": TierCost("host", 0.0, 1e12), "lmdb": TierCost("lmdb", 0.0, lmdb_rate)},
        PrefillCost(5e-3, 60e-6, 0.0),
        META.payload_bytes,
        16,
    )
    side = OffloadScheduler(below, NS, decision="cost", cost_model=model, stats=OffloadStats())
    long, short = request(650, "long"), other_request(70, "short")
    store_in_lmdb(below, long, 40)
    store_in_lmdb(below, short, 3)
    assert side.get_num_new_matched_tokens(long, 0) == ExternalHit(640, True)
    side.update_state_after_alloc(long, list(range(41)), 0, 640)
    assert side.load_backlog() == {"lmdb": 40}
    assert side.get_num_new_matched_tokens(short, 0) == ExternalHit()
    side.update_state_after_alloc(short, [50, 51, 52, 53, 54], 0, 0)
    assert short.kv_decision == "recompute" and short.kv_plan is not None
    assert short.kv_plan["backlog_s"] == pytest.approx(0.008)
    assert short.kv_plan["predicted_s"] == pytest.approx(5e-3 + 70 * 60e-6)
    # What it weighed, the chosen option first: recompute against a load behind the backlog.
    options = short.kv_plan["options"]
    assert list(options)[0] == "recompute"
    assert options["recompute"] == [pytest.approx(5e-3 + 70 * 60e-6), 1.0]
    assert options["load_prefix"][0] == pytest.approx(0.008 + 3 * 2e-4 + 5e-3 + 22 * 60e-6)
    assert long.kv_plan is not None and long.kv_plan["backlog_s"] == 0.0
    assert side.stats.snapshot()["backlog_decisions"] == 1
    # The long load reported: the same prompt loads again.
    side.update_from_worker(WorkerReport((LoadResult("long", 40, 40, 0.01),)))
    again = other_request(70, "again")
    assert side.get_num_new_matched_tokens(again, 0) == ExternalHit(48, True)
    assert side.stats.snapshot()["backlog_decisions"] == 1


def test_offload_config_parsing_and_defaults(tmp_path: Path) -> None:
    cfg = load_offload_config(
        {
            "decision": "recompute",
            "load_timeout_s": 2,
            "tiers": [{"kind": "host", "capacity": "1MiB"}],
        }
    )
    assert cfg.decision == "recompute" and cfg.load_timeout_s == 2.0
    assert cfg.in_step_host_loads is True
    host = [{"kind": "host", "capacity": "1B"}]
    assert not load_offload_config({"tiers": host, "in_step_host_loads": False}).in_step_host_loads
    with pytest.raises(ConfigError, match="in_step_host_loads must be true or false"):
        load_offload_config({"tiers": host, "in_step_host_loads": "yes"})
    assert cfg.in_step_loads_per_step == 0
    assert (
        load_offload_config({"tiers": host, "in_step_loads_per_step": 1}).in_step_loads_per_step
        == 1
    )
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="in_step_loads_per_step must be an integer >= 0"):
            load_offload_config({"tiers": host, "in_step_loads_per_step": bad})
    assert cfg.layered_loads == "auto" and cfg.layer_wise  # raw blocks too (staged 2-D copies)
    assert not load_offload_config({"tiers": host, "layered_loads": False}).layer_wise
    assert load_offload_config({"tiers": host, "compression": "lossless"}).layer_wise
    assert load_offload_config({"tiers": host, "layered_loads": True}).layer_wise
    assert not load_offload_config(
        {"tiers": host, "compression": "lossless", "layered_loads": False}
    ).layer_wise
    for bad in (1, "yes"):
        with pytest.raises(ConfigError, match="layered_loads must be true, false or auto"):
            load_offload_config({"tiers": host, "layered_loads": bad})
    assert cfg.layers_per_copy == 0
    assert load_offload_config({"tiers": host, "layers_per_copy": 4}).layers_per_copy == 4
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(ConfigError, match="layers_per_copy must be an integer >= 0"):
            load_offload_config({"tiers": host, "layers_per_copy": bad})
    assert cfg.load_issue_ahead == 0  # every group issued before the forward
    assert load_offload_config({"tiers": host, "load_issue_ahead": 4}).load_issue_ahead == 4
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(ConfigError, match="load_issue_ahead must be an integer >= 0"):
            load_offload_config({"tiers": host, "load_issue_ahead": bad})
    assert cfg.coalesced_loads is False
    assert load_offload_config({"tiers": host, "coalesced_loads": True}).coalesced_loads
    with pytest.raises(ConfigError, match="coalesced_loads must be true or false"):
        load_offload_config({"tiers": host, "coalesced_loads": "on"})
    assert cfg.tiers.tiers == (HostTierConfig(capacity=1 << 20),)
    yaml_path = tmp_path / "offload.yaml"
    yaml_path.write_text("tiers:\n  - {kind: lmdb, path: /x, capacity: 1GiB}\n")
    assert load_offload_config(yaml_path).decision == "cost"
    with pytest.raises(ConfigError, match="unknown field"):
        load_offload_config({"tiers": [{"kind": "host", "capacity": "1B"}], "policy": "x"})
    with pytest.raises(ConfigError, match="decision 'maybe'"):
        load_offload_config({"tiers": [{"kind": "host", "capacity": "1B"}], "decision": "maybe"})
    with pytest.raises(ConfigError, match="'tiers' is empty"):
        load_offload_config({"tiers": []})
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:   2048 kB\n")
    assert mem_available_bytes(str(meminfo)) == 2048 * 1024
    assert default_cache_dir({"KVTIER_CACHE_DIR": "/c"}) == Path("/c")
    assert default_cache_dir({"HOME": "/h"}) == Path("/h/.cache/kvtier")
    small = default_offload_config("abc", mem_available=8 << 20, cache_dir=Path("/c"))
    assert small.tiers.tiers == (
        HostTierConfig(capacity=2 << 20),
        LmdbTierConfig(path="/c/lmdb/abc", capacity=32 << 30),
    )
    big = default_offload_config("abc", mem_available=64 << 30, cache_dir=Path("/c"))
    assert big.tiers.tiers[0] == HostTierConfig(capacity=8 << 30)
