"""The offload worker against a real store (host over LMDB) and a real CPU KV cache: what each
load reports to the cost model (one hop per tier run, the scatter under ``host``) and what
lands in the GPU blocks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cachestore.codec import encode_block, encoded_size
from cachestore.cost.online import OnlineCostModel, default_priors
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from cachestore.store.loads import HostCheck
from connectors.offload.metadata import BlockLoad, KVConnectorMetadata
from connectors.offload.stats import OffloadStats
from connectors.offload.worker import OffloadWorker, block_meta
from engine.kv_cache import KVCache, KVCacheSpec
from tiers import build_tiers
from tiers.config import parse_tier_config

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
def parts(
    tmp_path: Path,
) -> Iterator[tuple[OffloadWorker, HierarchicalStore, KVCache, RecordingCostModel]]:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    cache = KVCache(spec, 8, "cpu")
    meta = block_meta(cache, PREFIX)
    config = parse_tier_config(
        {
            "tiers": [
                {"kind": "host", "capacity": f"{4 * encoded_size(meta, keyed=True)}B"},
                {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "8MiB"},
            ]
        }
    )
    store = HierarchicalStore(
        build_tiers(config, host_slot_bytes=encoded_size(meta, keyed=True)),
        StoreConfig(namespace=PREFIX, promote_on_get=False),
    )
    model = RecordingCostModel()
    worker = OffloadWorker(
        cache, store, meta, load_timeout_s=5.0, stats=OffloadStats(), cost_model=model
    )
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
    encoded = [
        (k, encode_block(b.numpy().tobytes(), worker.meta, key=k))
        for k, b in zip(keys, blobs, strict=True)
    ]
    store.tiers[1].put_many(encoded[2:])  # the third block lives only in LMDB
    store.put_many(encoded[:2])
    assert store.lookup(keys).served_by == (0, 0, 1)
    spec = store.prepare_load(keys, HostCheck.for_meta(worker.meta))
    load = BlockLoad("r", (5, 3, 6), tuple(keys), 0, ("host", "host", "lmdb"), spec=spec)
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


def test_blocks_on_their_way_to_lmdb_load_into_the_cache(
    parts: tuple[OffloadWorker, HierarchicalStore, KVCache, RecordingCostModel],
) -> None:
    """Saved blocks the 4-slot host tier evicted while LMDB's writer is held: queued for LMDB,
    written nowhere yet. The scheduler finds them (as LMDB's) and the worker loads them with
    the bytes that were saved."""
    from connectors.offload.metadata import BlockSave

    worker, store, cache, _ = parts
    lmdb = store.tiers[1]
    keys = [f"{PREFIX}/w{i}" for i in range(7)]
    blobs = [block(float(i + 1), cache) for i in range(7)]
    with lmdb._lock:  # LMDB's writer waits
        for i in range(7):
            cache.tensor[i] = blobs[i]
            worker.save_now((BlockSave(i, keys[i]),))
        assert not any(k in lmdb._index for k in keys)
        assert store.lookup(keys).served_by == (1, 1, 1, 0, 0, 0, 0)
        cache.tensor[:7] = 0.0
        spec = store.prepare_load(keys[:3], HostCheck.for_meta(worker.meta))
        load = BlockLoad("w", (5, 6, 7), tuple(keys[:3]), 0, ("lmdb",) * 3, spec=spec)
        worker.start_load_kv(KVConnectorMetadata(loads=(load,), num_scheduled_requests=0))
        [res] = worker.take_report().finished_loads
    assert (res.req_id, res.num_loaded_blocks) == ("w", 3)
    for block_id, expected in zip((5, 6, 7), blobs[:3], strict=True):
        assert torch.equal(cache.tensor[block_id], expected)
    assert store.stats()["tiers"][1]["inflight_hits"] >= 3


def test_a_short_read_stops_at_the_first_missing_block(
    parts: tuple[OffloadWorker, HierarchicalStore, KVCache, RecordingCostModel],
) -> None:
    worker, store, cache, model = parts
    keys = [f"{PREFIX}/{i:02x}" for i in range(3)]
    blob = block(7.0, cache)
    store.tiers[1].put_many(
        [(keys[0], encode_block(blob.numpy().tobytes(), worker.meta, key=keys[0]))]
    )
    load = BlockLoad("r", (1, 2, 4), tuple(keys), 0, ("lmdb", "lmdb", "lmdb"))
    worker.start_load_kv(KVConnectorMetadata(loads=(load,), num_scheduled_requests=0))
    [result] = worker.take_report().finished_loads
    assert (result.num_loaded_blocks, result.num_requested_blocks) == (1, 3)
    assert model.transfers == [("lmdb", cache.bytes_per_block), ("host", cache.bytes_per_block)]
    assert torch.equal(cache.tensor[1], blob) and bool((cache.tensor[2] == 0).all())


def _host_blocks(
    worker: OffloadWorker, store: HierarchicalStore, cache: KVCache, n: int
) -> tuple[list[str], list[torch.Tensor]]:
    keys = [f"{PREFIX}/{i:02x}" for i in range(n)]
    blobs = [block(float(i + 2), cache) for i in range(n)]
    store.put_many(
        [
            (k, encode_block(b.numpy().tobytes(), worker.meta, key=k))
            for k, b in zip(keys, blobs, strict=True)
        ]
    )
    return keys, blobs


class _CountingXXH:
    """Stands in for the ``xxhash`` module inside the codec: counts checksum calls."""

    def __init__(self) -> None:
        import xxhash

        self.calls = 0
        self._real = xxhash

    def xxh3_64_intdigest(self, data: object) -> int:
        self.calls += 1
        return self._real.xxh3_64_intdigest(data)


def test_host_tier_loads_skip_the_checksum_and_copy_the_exact_bytes(
    parts: tuple[OffloadWorker, HierarchicalStore, KVCache, RecordingCostModel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import cachestore.codec as codec

    worker, store, cache, model = parts
    keys, blobs = _host_blocks(worker, store, cache, 3)
    counter = _CountingXXH()
    monkeypatch.setattr(codec, "xxhash", counter)
    spec = store.prepare_load(keys, HostCheck.for_meta(worker.meta))
    load = BlockLoad("r", (6, 1, 3), tuple(keys), 0, ("host",) * 3, spec=spec)
    worker.start_load_kv(KVConnectorMetadata(loads=(load,), num_scheduled_requests=1))
    [result] = worker.take_report().finished_loads  # reported in the step it landed
    assert (result.num_loaded_blocks, counter.calls) == (3, 0)
    for block_id, expected in zip((6, 1, 3), blobs, strict=True):
        assert torch.equal(cache.tensor[block_id], expected)
    assert model.transfers == [("host", 3 * cache.bytes_per_block)]
    assert store.stats()["load_pins"] == 0
    assert all(e.pins == 0 for e in store.tiers[0]._entries.values())
    # A read through the store still verifies every byte.
    assert store.get_many(keys[:1])[0] is not None and counter.calls == 1


def test_a_wrong_namespace_slot_is_not_loaded(
    parts: tuple[OffloadWorker, HierarchicalStore, KVCache, RecordingCostModel],
) -> None:
    worker, store, cache, _ = parts
    keys, blobs = _host_blocks(worker, store, cache, 1)
    # Same encoded size (namespaces of equal length) so only the header tells them apart.
    alien = block_meta(cache, "ns-tesX")
    bad_key = f"{PREFIX}/bad"
    other = encode_block(block(9.0, cache).numpy().tobytes(), alien, key=bad_key)
    assert len(other) == encoded_size(worker.meta, keyed=True)
    store.tiers[0].put_many([(bad_key, other)])
    spec = store.prepare_load((keys[0], bad_key), HostCheck.for_meta(worker.meta))
    load = BlockLoad("r", (2, 4), (keys[0], bad_key), 0, ("host", "host"), spec=spec)
    worker.start_load_kv(KVConnectorMetadata(loads=(load,), num_scheduled_requests=0))
    [result] = worker.take_report().finished_loads
    assert (result.num_loaded_blocks, result.num_requested_blocks) == (1, 2)
    assert torch.equal(cache.tensor[2], blobs[0]) and bool((cache.tensor[4] == 0).all())
    assert all(e.pins == 0 for e in store.tiers[0]._entries.values())


def test_slab_entries_stay_pinned_until_the_copy_completes(
    parts: tuple[OffloadWorker, HierarchicalStore, KVCache, RecordingCostModel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import connectors.offload.loads as ow

    worker, store, cache, _ = parts
    keys, blobs = _host_blocks(worker, store, cache, 2)
    in_flight = [True]
    monkeypatch.setattr(ow, "_done", lambda event: not in_flight[0])  # the copy's event
    spec = store.prepare_load(keys, HostCheck.for_meta(worker.meta))
    load = BlockLoad("r", (0, 5), tuple(keys), 0, ("host", "host"), spec=spec)
    worker.start_load_kv(KVConnectorMetadata(loads=(load,), num_scheduled_requests=1))
    assert worker.take_report().finished_loads == ()
    # The host tier (4 slots) fills up: the two entries being copied must survive.
    filler = [
        (
            f"{PREFIX}/f{i}",
            encode_block(
                block(50.0 + i, cache).numpy().tobytes(), worker.meta, key=f"{PREFIX}/f{i}"
            ),
        )
        for i in range(4)
    ]
    store.put_many(filler)
    assert store.tiers[0].lookup(keys) == 2
    in_flight[0] = False
    [result] = worker.take_report().finished_loads
    assert result.num_loaded_blocks == 2
    assert torch.equal(cache.tensor[5], blobs[1])
    store.put_many([(f"{PREFIX}/g{i}", v) for i, (_, v) in enumerate(filler)])
    assert store.tiers[0].lookup(keys) == 0  # released: now evictable


def test_saves_land_in_host_slots_and_demote_with_valid_checksums(
    parts: tuple[OffloadWorker, HierarchicalStore, KVCache, RecordingCostModel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cachestore.codec import decode_block
    from connectors.offload.metadata import BlockSave

    worker, store, cache, _ = parts
    for b in range(6):
        cache.tensor[b] = block(100.0 + b, cache)

    def no_put(items: object) -> int:
        raise AssertionError("saves must go through reserve/commit, not put_many")

    monkeypatch.setattr(store, "put_many", no_put)
    saves = tuple(BlockSave(b, f"{PREFIX}/s{b}") for b in range(6))
    for step in (saves[:3], saves[3:]):  # 4 host slots; reserved ones are not evictable
        worker.start_load_kv(KVConnectorMetadata(saves=step, num_scheduled_requests=1))
        for s in step:  # the forward may reuse the blocks: the copies were taken already
            cache.tensor[s.block_id] = 0
        worker.wait_for_save()
    store.flush()
    host, lmdb = store.tiers
    # 4 host slots: the two oldest saves were evicted by later reserves and demoted to LMDB.
    assert host.lru_keys() == [s.key for s in saves[2:]]
    for s in saves:
        value = host.get_many([s.key])[0] if s.key in host.lru_keys() else lmdb.get_many([s.key])[0]
        assert value is not None, s.key
        payload = decode_block(value, PREFIX).payload  # checksum verified
        expected = block(100.0 + s.block_id, cache)
        assert torch.equal(
            torch.frombuffer(bytearray(payload), dtype=torch.float32).view(expected.shape), expected
        )
    assert lmdb.lookup([saves[0].key]) == 1 and lmdb.lookup([saves[1].key]) == 1
    assert worker.stats.snapshot()["saved_blocks"] == 6


@pytest.mark.gpu
def test_cuda_saves_and_host_fast_path_loads_round_trip(tmp_path: Path) -> None:
    """On CUDA: saves land in the pinned slab via the side stream and the seal thread; host
    loads are non_blocking slab -> cache copies on the side stream, reported once landed."""
    from connectors.offload.metadata import BlockSave

    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    cache = KVCache(spec, 16, "cuda")
    meta = block_meta(cache, PREFIX)
    config = parse_tier_config(
        {
            "tiers": [
                {"kind": "host", "capacity": f"{4 * encoded_size(meta, keyed=True)}B"},
                {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"},
            ]
        }
    )
    store = HierarchicalStore(
        build_tiers(config, host_slot_bytes=encoded_size(meta, keyed=True)),
        StoreConfig(namespace=PREFIX, promote_on_get=False),
    )
    assert store.tiers[0].pinned_memory
    worker = OffloadWorker(
        cache, store, meta, load_timeout_s=30.0, stats=OffloadStats(), hold_async_copies=True
    )
    try:
        blobs = [
            torch.full(spec.block_shape, float(b + 1), dtype=spec.dtype, device="cuda")
            for b in range(6)
        ]
        for b in range(6):
            cache.tensor[b] = blobs[b]
        saves = tuple(BlockSave(b, f"{PREFIX}/c{b}") for b in range(6))
        for step in (saves[:3], saves[3:]):
            worker.start_load_kv(
                KVConnectorMetadata(saves=step, num_scheduled_requests=1, saves_reuse_blocks=True)
            )
            for s in step:  # reuse: the compute stream waited for the gather
                cache.tensor[s.block_id] = -7.0
            worker.wait_for_save()
        worker.save_now(())
        store.flush()
        keys = tuple(s.key for s in saves)
        assert store.lookup(keys).served_by == (1, 1, 0, 0, 0, 0)
        targets = (15, 9, 8, 12)
        spec = store.prepare_load(keys[2:], HostCheck.for_meta(meta))
        load = BlockLoad("h", targets, keys[2:], 0, ("host",) * 4, spec=spec)
        worker.start_load_kv(KVConnectorMetadata(loads=(load,), num_scheduled_requests=0))
        [res] = worker.take_report().finished_loads
        assert res.num_loaded_blocks == 4
        torch.cuda.synchronize()
        for t, b in zip(targets, range(2, 6), strict=True):
            assert torch.equal(cache.tensor[t], blobs[b])
        spec = store.prepare_load(keys[:2], HostCheck.for_meta(meta))
        load = BlockLoad("l", (13, 14), keys[:2], 0, ("lmdb", "lmdb"), spec=spec)
        worker.start_load_kv(KVConnectorMetadata(loads=(load,), num_scheduled_requests=0))
        [res] = worker.take_report().finished_loads
        assert res.num_loaded_blocks == 2
        torch.cuda.synchronize()
        assert torch.equal(cache.tensor[13], blobs[0]) and torch.equal(cache.tensor[14], blobs[1])
        # With hold_async_copies, a busy step holds an async load's host copies until its
        # forward is queued.
        cache.tensor[10] = 0.0
        # (keys[0] is in the host tier again: the lmdb load above promoted it)
        spec = store.prepare_load(keys[:1], HostCheck.for_meta(meta))
        assert len(spec.host_offsets) == 1
        load = BlockLoad("held", (10,), keys[:1], 0, ("host",), spec=spec)
        worker.start_load_kv(KVConnectorMetadata(loads=(load,), num_scheduled_requests=1))
        torch.cuda.synchronize()
        assert worker.take_report().finished_loads == ()
        assert not bool(cache.tensor[10].any())
        worker.forward_queued()
        torch.cuda.synchronize()
        [res] = worker.take_report().finished_loads
        assert (res.req_id, res.num_loaded_blocks) == ("held", 1)
        assert torch.equal(cache.tensor[10], blobs[0])
        assert all(e.pins == 0 for e in store.tiers[0]._entries.values())
    finally:
        worker.close()
        store.close()


def test_an_idle_save_on_the_cpu_is_visible_when_it_returns(parts) -> None:
    """``save_now(wait=False)`` (the engine going idle) seals on the caller's thread on the CPU:
    the blocks are in the host tier, with valid checksums, when it returns."""
    from connectors.offload.metadata import BlockSave

    worker, store, cache, _ = parts
    for b in range(3):
        cache.tensor[b] = float(b + 2)
    keys = tuple(f"{PREFIX}/idle{b}" for b in range(3))
    worker.save_now(tuple(BlockSave(b, k) for b, k in enumerate(keys)), wait=False)
    assert store.lookup(keys).served_by == (0, 0, 0)
    assert all(v is not None for v in store.get_many(keys))


@pytest.mark.gpu
def test_an_idle_save_on_cuda_does_not_wait_for_the_seals(tmp_path: Path) -> None:
    """On CUDA the idle save issues the copies and hands the checksums to the seal thread: it
    returns before the blocks are sealed (the seal thread steps aside, up to 20 ms a block,
    while a step's launches hold the gate: held here throughout), and a drain makes them all
    visible with the bytes the cache held."""
    from cachestore.launch_gate import STEP_LAUNCHES
    from connectors.offload.metadata import BlockSave

    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    n = 24
    cache = KVCache(spec, n, "cuda")
    meta = block_meta(cache, PREFIX)
    config = parse_tier_config(
        {"tiers": [{"kind": "host", "capacity": f"{(n + 4) * encoded_size(meta, keyed=True)}B"}]}
    )
    store = HierarchicalStore(
        build_tiers(config, host_slot_bytes=encoded_size(meta, keyed=True)),
        StoreConfig(namespace=PREFIX, promote_on_get=False),
    )
    worker = OffloadWorker(cache, store, meta, load_timeout_s=30.0, stats=OffloadStats())
    try:
        for b in range(n):
            cache.tensor[b] = float(b + 1)
        keys = tuple(f"{PREFIX}/idle{b}" for b in range(n))
        STEP_LAUNCHES.hold()
        try:
            worker.save_now(tuple(BlockSave(b, k) for b, k in enumerate(keys)), wait=False)
            visible = len(store.lookup(keys).served_by)
        finally:
            STEP_LAUNCHES.release()
        assert visible < n, visible  # sealing ~20 ms a block behind the held gate
        worker.save_now((), wait=True)
        assert store.lookup(keys).served_by == (0,) * n
        expected = [cache.tensor[b].cpu() for b in range(n)]
        for b, value in enumerate(store.get_many(keys)):
            assert value is not None
            got = torch.frombuffer(bytearray(value), dtype=spec.dtype).view(spec.block_shape)
            assert torch.equal(got, expected[b])
    finally:
        worker.close()
        store.close()


def test_in_step_copies_are_issued_before_an_async_load_listed_first(
    parts: tuple[OffloadWorker, HierarchicalStore, KVCache, RecordingCostModel],
) -> None:
    """A step's forward waits for its in-step loads only: their copies must reach the copy
    stream before an async load's, whatever order the metadata lists them in (an async load
    listed first would otherwise hold the forward behind its own copies)."""
    worker, store, cache, _ = parts
    keys, blobs = _host_blocks(worker, store, cache, 2)
    check = HostCheck.for_meta(worker.meta)
    async_spec = store.prepare_load(keys[:1], check)
    in_step_spec = store.prepare_load(keys[1:], check, claim=False)
    loads = (
        BlockLoad("async", (4,), (keys[0],), 0, ("host",), spec=async_spec),
        BlockLoad(
            "in-step", (6,), (keys[1],), 0, ("host",), in_step_spec.host_offsets, in_step_spec
        ),
    )
    copies = worker._loader._copies  # type: ignore[attr-defined]
    order: list[str] = []
    real_copy = copies.copy

    def recording_copy(pending, offsets, forward_reads=False):  # type: ignore[no-untyped-def]
        if offsets:
            order.append(pending.load.req_id)
        return real_copy(pending, offsets, forward_reads)

    copies.copy = recording_copy
    worker.start_load_kv(KVConnectorMetadata(loads=loads, num_scheduled_requests=1))
    report = worker.take_report()
    assert order == ["in-step", "async"]
    assert sorted((r.req_id, r.num_loaded_blocks) for r in report.finished_loads) == [
        ("async", 1),
        ("in-step", 1),
    ]
    assert torch.equal(cache.tensor[4], blobs[0]) and torch.equal(cache.tensor[6], blobs[1])
    assert store.stats()["load_pins"] == 0
