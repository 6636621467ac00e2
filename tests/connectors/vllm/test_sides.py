"""The vLLM connector's vLLM-free parts on real tiers: keys, config, the scheduler side over a
lookup view of LMDB written by another process, the worker side on vLLM-shaped CPU tensors.
(Inside vLLM: tests/vllm/, ``make test-vllm``.)"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from cachestore.cost.online import CostPriors, OnlineCostModel, default_priors
from cachestore.hashing import hash_request_tokens
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from cachestore.store.types import write_policies
from connectors.vllm.config import parse_connector_config
from connectors.vllm.keys import RequestKeys, layout_name, make_namespace
from connectors.vllm.lookup import build_lookup_store
from connectors.vllm.scheduler import ScheduledRequest, VllmScheduler
from connectors.vllm.stats import Counters
from connectors.vllm.worker import KvLayout, VllmWorker
from tiers import build_tiers
from tiers.config import ConfigError

ROOT = Path(__file__).resolve().parents[3]
BS, LAYERS, HEADS, HEAD = 32, 2, 1, 64
LAYOUT = layout_name("torch.float32", LAYERS, HEADS, HEAD, BS)
NS = make_namespace("LlamaForCausalLM-test", LAYOUT, BS)


@dataclass
class Req:  # the attributes of vLLM's Request the scheduler side reads
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    mm_features: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def _caches(num_blocks: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"layers.{i}.attn": torch.randn(num_blocks, HEADS, BS, 2 * HEAD, generator=g)
        for i in range(LAYERS)
    }  # vLLM 0.32's CPU layout


def _worker(stack_dict: dict, caches: dict[str, torch.Tensor]) -> VllmWorker:
    config = parse_connector_config(stack_dict)
    layout = KvLayout.from_caches(caches, next(iter(caches.values())).shape[0])
    meta = layout.block_meta(NS.key_prefix(), LAYOUT)
    stack = config.offload.tiers
    store = HierarchicalStore(
        build_tiers(stack, host_slot_bytes=64 << 10),
        StoreConfig(namespace=NS.key_prefix(), write_policies=write_policies(stack)),
    )
    return VllmWorker(store, layout, meta, Counters(), BS)


def _scheduler(stack_dict: dict, decision: str = "load") -> VllmScheduler:
    config = parse_connector_config(stack_dict)
    base = default_priors("cpu")
    cost = OnlineCostModel.from_priors(
        CostPriors(
            "cpu", dict(base.tier_costs), base.prefill, LAYERS * HEADS * BS * 2 * HEAD * 4, BS
        )
    )
    store = build_lookup_store(config.offload.tiers, NS.key_prefix())
    return VllmScheduler(store, NS, cost, decision, Counters())


def test_keys_chain_token_ids_under_a_namespace_of_everything_incompatible():
    tokens = list(range(3, 3 + 5 * BS + 7))
    keys = RequestKeys(NS)
    assert keys.first(tokens, 2) == keys.first(tokens, 2)
    five = keys.first(tokens, 9)  # at most the full blocks
    assert len(five) == 5 and five[:2] == keys.first(tokens, 2)
    assert [k.split("/")[1] for k in five] == [h.hex() for h in hash_request_tokens(NS, tokens)]
    others = [
        make_namespace("LlamaForCausalLM-test", LAYOUT, BS, tp_rank=1, tp_size=2),
        make_namespace("LlamaForCausalLM-test", layout_name("bfloat16", 2, 1, 64, 32), BS),
        make_namespace("LlamaForCausalLM-other", LAYOUT, BS),
        make_namespace("LlamaForCausalLM-test", LAYOUT, 64),
    ]
    assert len({NS.key_prefix(), *(o.key_prefix() for o in others)}) == 5
    assert RequestKeys(NS, ("salt=a",)).first(tokens, 1) != five[:1]


def test_config_takes_the_offload_yaml_inline_or_as_a_file(tmp_path):
    tiers = [
        {"kind": "host", "capacity": "1MiB"},
        {"kind": "lmdb", "path": str(tmp_path / "l"), "capacity": "8MiB"},
    ]
    inline = parse_connector_config({"tiers": tiers, "decision": "cost", "stats_file": "/x"})
    path = tmp_path / "tiers.yaml"
    path.write_text(
        f"decision: load\ntiers:\n  - {{kind: lmdb, path: {tmp_path}, capacity: 8MiB}}\n"
    )
    from_file = parse_connector_config({"kvtier_config": str(path)})
    assert inline.has_host_tier and inline.stats_file == "/x" and inline.decision == "cost"
    assert from_file.decision == "load" and not from_file.has_host_tier
    for bad, msg in [
        ({}, "kvtier_config"),
        ({"tiers": tiers[:1]}, "below 'host'"),
        ({"tiers": tiers, "decision": "overlap"}, "prefix"),
        ({"tiers": tiers, "compression": "lossless"}, "compression"),
        ({"kvtier_config": str(path), "x": 1}, "unknown"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            parse_connector_config(bad)


def test_saved_blocks_load_back_into_other_blocks_and_misses_are_load_errors(tmp_path):
    stack = {
        "tiers": [
            {"kind": "host", "capacity": "4MiB"},
            {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"},
        ]
    }
    src = _caches(8, seed=1)
    keys = RequestKeys(NS).first(list(range(3, 3 + 3 * BS)), 3)
    from connectors.vllm.metadata import LoadJob, SaveJob

    worker = _worker(stack, src)
    worker.save([SaveJob("r", tuple(keys), (5, 1, 6))])
    worker.wait_saves()
    worker.close()  # drains the write-through copy into LMDB
    dst = _caches(8, seed=2)
    again = _worker({"tiers": stack["tiers"][1:]}, dst)  # a new "process": LMDB only
    missing = RequestKeys(NS).first(list(range(9, 9 + BS)), 1)[0]
    failed = again.load([LoadJob("r", (*keys, missing), (0, 2, 3, 4), ("lmdb",) * 4)])
    assert failed == {4}
    for name in src:
        for s, d in ((5, 0), (1, 2), (6, 3)):
            assert torch.equal(dst[name][d], src[name][s])
    assert again.counters.totals()["loaded_tokens"] == 3 * BS
    again.close()


def test_scheduler_plans_loads_of_the_leading_run_another_process_wrote(tmp_path):
    lmdb = str(tmp_path / "lmdb")
    tokens = list(range(3, 3 + 4 * BS + 5))
    keys = RequestKeys(NS).first(tokens, 4)
    # Another process holds the writable LMDB tier (as vLLM's worker does) and wrote 3 blocks.
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys; from tiers.lmdb import LmdbTier; from cachestore.codec import *\n"
                f"t = LmdbTier({lmdb!r}, 64 << 20)\n"
                f"m = BlockMeta('float32', (4,), 'x', {NS.key_prefix()!r})\n"
                f"t.put_many([(k, encode_block(bytes(16), m, key=k)) for k in {keys[:3]!r}])\n"
                "print('ready', flush=True); sys.stdin.readline()"
            ),
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        sched = _scheduler({"tiers": [{"kind": "lmdb", "path": lmdb, "capacity": "64MiB"}]})
        req = Req("r1", tokens)
        assert sched.matched_tokens(req, 0) == 3 * BS
        assert sched.matched_tokens(req, BS) == 2 * BS  # past vLLM's own hit of one block
        sched.after_alloc(req, [10, 11, 12, 13, 14], 2 * BS)
        plan = sched.build_step(
            [ScheduledRequest("r1", 3 * BS, len(tokens) - 3 * BS, [10, 11, 12, 13, 14])]
        )
        assert [(j.keys, j.block_ids, j.tiers) for j in plan.loads] == [
            (tuple(keys[1:3]), (11, 12), ("lmdb", "lmdb"))
        ]
        # Saves: the blocks this step fills, not the loaded nor vLLM's hit ones; once each.
        assert [(s.keys, s.block_ids) for s in plan.saves] == [((keys[3],), (13,))]
        assert (
            sched.build_step([ScheduledRequest("r1", len(tokens), 1, [10, 11, 12, 13, 14])]).saves
            == ()
        )
        assert sched.matched_tokens(Req("r3", tokens[: 3 * BS]), 0) == 2 * BS  # >= 1 computed
        assert sched.matched_tokens(Req("r4", tokens, mm_features=["img"]), 0) == 0
        sched.store.close()  # one LMDB environment per path and process
        for decision, expect in (("recompute", 0), ("cost", 3 * BS)):
            # CPU priors: a 32 KiB block reads from LMDB faster than 32 tokens compute
            other = _scheduler(
                {"tiers": [{"kind": "lmdb", "path": lmdb, "capacity": "64MiB"}]}, decision
            )
            assert other.matched_tokens(Req("r5", tokens), 0) == expect, decision
            other.store.close()
    finally:
        writer.communicate("\n", timeout=30)


def test_the_scheduler_finds_lmdb_blocks_with_the_worker_in_its_own_process(tmp_path):
    """One GPU: vLLM's uni executor runs the worker inside the engine-core process, so the
    scheduler side's LMDB view and the worker's ``LmdbTier`` share one process, where LMDB
    allows one environment per path. The view reads through the tier (before, its open failed
    "already open in this process", the tier showed down and nothing was loaded from LMDB);
    and a view that opened the directory first gives it up when the tier opens it."""
    lmdb = str(tmp_path / "lmdb")
    lmdb_only = {"tiers": [{"kind": "lmdb", "path": lmdb, "capacity": "64MiB"}]}
    stack = {"tiers": [{"kind": "host", "capacity": "4MiB"}, *lmdb_only["tiers"]]}
    tokens = list(range(3, 3 + 4 * BS + 5))
    keys = RequestKeys(NS).first(tokens, 4)
    from connectors.vllm.metadata import SaveJob

    # the worker first (vLLM registers the KV caches before it builds the scheduler)
    worker = _worker(stack, _caches(8, seed=1))
    worker.save([SaveJob("r", tuple(keys[:3]), (5, 1, 6))])
    worker.wait_saves()
    assert worker.store.wait_writes(10.0)  # the write-through copies reached LMDB
    sched = _scheduler(lmdb_only)
    assert sched.matched_tokens(Req("r1", tokens), 0) == 3 * BS
    lmdb_row = next(t for t in sched.store.stats()["tiers"] if t["name"] == "lmdb")
    assert lmdb_row["errors"] == 0
    sched.store.close()
    worker.close()
    # the view first, on its own environment; then a worker opens the same directory
    sched = _scheduler(lmdb_only)
    assert sched.matched_tokens(Req("r2", tokens), 0) == 3 * BS
    again = _worker(stack, _caches(8, seed=2))  # opens LMDB: the view's environment closes
    again.save([SaveJob("r", (keys[3],), (2,))])
    again.wait_saves()
    assert again.store.wait_writes(10.0)
    assert sched.matched_tokens(Req("r3", tokens), 0) == 4 * BS  # through the worker's tier
    sched.store.close()
    again.close()
