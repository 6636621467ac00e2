"""The offload worker against a real store (host over LMDB) and a real CPU KV cache: what each
load reports to the cost model (one hop per tier run, the scatter under ``host``) and what
lands in the GPU blocks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cachestore.codec import encode_block, encoded_size
from cachestore.cost_online import OnlineCostModel, default_priors
from cachestore.store import HierarchicalStore, StoreConfig
from cachestore.tier_config import build_tiers, parse_tier_config
from connectors.base import BlockLoad, KVConnectorMetadata
from connectors.offload_stats import OffloadStats
from connectors.offload_worker import OffloadWorker, block_meta
from engine.kv_cache import KVCache, KVCacheSpec

PREFIX = "ns-test"


class RecordingCostModel(OnlineCostModel):
    def __init__(self) -> None:
        p = default_priors("cpu")
        super().__init__(dict(p.tier_costs), p.prefill, 1024, 16)
        self.transfers: list[tuple[str, int]] = []

    def observe_transfer(self, tier: str, nbytes: int, seconds: float) -> None:
        assert seconds > 0
        self.transfers.append((tier, nbytes))
        super().observe_transfer(tier, nbytes, seconds)


@pytest.fixture()
def parts(tmp_path: Path) -> Iterator[tuple[OffloadWorker, HierarchicalStore, KVCache, RecordingCostModel]]:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    cache = KVCache(spec, 8, "cpu")
    meta = block_meta(cache, PREFIX)
    config = parse_tier_config(
        {"tiers": [{"kind": "host", "capacity": 4 * encoded_size(meta)},
                   {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "8MiB"}]}
    )
    store = HierarchicalStore(
        build_tiers(config, host_slot_bytes=encoded_size(meta)),
        StoreConfig(namespace=PREFIX, promote_on_get=False),
    )
    model = RecordingCostModel()
    worker = OffloadWorker(cache, store, meta, load_timeout_s=5.0, stats=OffloadStats(),
                           cost_model=model)
    yield worker, store, cache, model
    worker.close()
    store.close()


def block(value: float, cache: KVCache) -> torch.Tensor:
    return torch.full(cache.spec.block_shape, value, dtype=torch.float32)


def test_a_load_from_two_tiers_reports_each_hop(
    parts: tuple[OffloadWorker, HierarchicalStore, KVCache, RecordingCostModel],
) -> None:
    worker, store, cache, model = parts
    size = cache.bytes_per_block
    keys = [f"{PREFIX}/{i:02x}" for i in range(3)]
    blobs = [block(float(i + 1), cache) for i in range(3)]
    encoded = [(k, encode_block(b.numpy().tobytes(), worker.meta)) for k, b in zip(keys, blobs, strict=True)]
    store.tiers[1].put_many(encoded[2:])  # the third block lives only in LMDB
    store.put_many(encoded[:2])
    assert store.lookup(keys).served_by == (0, 0, 1)
    store.prepare_load(keys)
    load = BlockLoad("r", (5, 3, 6), tuple(keys), 0, ("host", "host", "lmdb"))
    worker.start_load_kv(KVConnectorMetadata(loads=(load,), num_scheduled_requests=0))
    report = worker.take_report()
    assert [(r.req_id, r.num_loaded_blocks) for r in report.finished_loads] == [("r", 3)]
    # One LMDB read of one block (the host run is host memory already), then one scatter of
    # all three blocks: the host -> device hop.
    assert model.transfers == [("lmdb", size), ("host", 3 * size)]
    snap = model.snapshot()["tiers"]
    assert snap["lmdb"]["num_samples"] == 1 and snap["host"]["num_samples"] == 1
    for block_id, expected in zip((5, 3, 6), blobs, strict=True):
        assert torch.equal(cache.tensor[block_id], expected)
    assert bool((cache.tensor[[0, 1, 2, 4, 7]] == 0).all())


def test_a_short_read_stops_at_the_first_missing_block(
    parts: tuple[OffloadWorker, HierarchicalStore, KVCache, RecordingCostModel],
) -> None:
    worker, store, cache, model = parts
    keys = [f"{PREFIX}/{i:02x}" for i in range(3)]
    blob = block(7.0, cache)
    store.tiers[1].put_many([(keys[0], encode_block(blob.numpy().tobytes(), worker.meta))])
    load = BlockLoad("r", (1, 2, 4), tuple(keys), 0, ("lmdb", "lmdb", "lmdb"))
    worker.start_load_kv(KVConnectorMetadata(loads=(load,), num_scheduled_requests=0))
    [result] = worker.take_report().finished_loads
    assert (result.num_loaded_blocks, result.num_requested_blocks) == (1, 3)
    assert model.transfers == [("lmdb", cache.bytes_per_block), ("host", cache.bytes_per_block)]
    assert torch.equal(cache.tensor[1], blob) and bool((cache.tensor[2] == 0).all())
