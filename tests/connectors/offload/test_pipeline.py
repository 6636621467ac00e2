"""Pipelined lower-tier loads (connectors/offload/pipeline.py) against a real LMDB tier in a temp
dir and a real CPU KV cache: a load of several chunks lands byte for byte what the unpipelined
path lands, stops at the first missing block, survives a cancel mid-way without leaving pins,
and an engine reloading from LMDB through it gives the greedy tokens of one without offload."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cachestore.codec import HeaderTemplate, encode_block, encoded_size
from cachestore.cost.online import OnlineCostModel
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from connectors.offload.config import parse_offload_config
from connectors.offload.metadata import BlockLoad, KVConnectorMetadata
from connectors.offload.pipeline import (
    READ_THREADS,
    LoadPipeline,
    PipeJob,
    chunk_blocks_for,
    pipeline_readers,
)
from connectors.offload.stats import OffloadStats
from connectors.offload.worker import OffloadWorker, block_meta
from engine import SamplingParams
from engine.kv_cache import KVCache, KVCacheSpec
from tests.connectors.offload.test_connector import SLOT, VOCAB, make_llm
from tests.connectors.offload.test_worker import RecordingCostModel
from tiers import build_tiers
from tiers.config import ConfigError, parse_tier_config

PREFIX = "ns-pipe"
N = 11  # 4 chunks of 3 blocks, the last one short


def _store(tmp_path: Path, slot: int, host_slots: int) -> HierarchicalStore:
    config = parse_tier_config(
        {
            "tiers": [
                {"kind": "host", "capacity": f"{host_slots * slot}B"},
                {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "16MiB"},
            ]
        }
    )
    return HierarchicalStore(
        build_tiers(config, host_slot_bytes=slot),
        StoreConfig(namespace=PREFIX, promote_on_get=False),
    )


@pytest.fixture()
def lmdb_blocks(tmp_path: Path) -> Iterator[tuple[HierarchicalStore, KVCache, list[str]]]:
    """``N`` random blocks that only the LMDB tier holds (a 2-slot host tier above it)."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    cache = KVCache(spec, 2 * N + 2, "cpu")
    meta = block_meta(cache, PREFIX)
    store = _store(tmp_path, encoded_size(meta, keyed=True), host_slots=2)
    gen = torch.Generator().manual_seed(5)
    keys = [f"{PREFIX}/{i:02x}" for i in range(N)]
    store.tiers[1].put_many(
        [
            (
                k,
                encode_block(
                    torch.randn(spec.block_shape, generator=gen).numpy().tobytes(), meta, key=k
                ),
            )
            for k in keys
        ]
    )
    yield store, cache, keys
    store.close()


def _worker(
    store: HierarchicalStore,
    cache: KVCache,
    chunk_blocks: int,
    timeout_s: float = 5.0,
    readers: int = 0,
    cost_model: OnlineCostModel | None = None,
) -> OffloadWorker:
    return OffloadWorker(
        cache,
        store,
        block_meta(cache, PREFIX),
        load_timeout_s=timeout_s,
        stats=OffloadStats(),
        cost_model=cost_model,
        load_chunk_bytes=chunk_blocks * cache.bytes_per_block,
        load_pipeline_depth=2,
        load_read_threads=readers,
    )


def _load(
    worker: OffloadWorker, store: HierarchicalStore, keys: list[str], block_ids: tuple[int, ...]
) -> tuple[int, float, float]:
    """One async load through an idle engine step: (blocks loaded, copy_s, read_s)."""
    spec = store.prepare_load(keys)
    load = BlockLoad("r", block_ids, tuple(keys), 0, ("lmdb",) * len(keys), spec=spec)
    worker.start_load_kv(KVConnectorMetadata(loads=(load,), num_scheduled_requests=0))
    [result] = worker.take_report().finished_loads
    return result.num_loaded_blocks, result.copy_s, result.read_s


def _load_all(store: HierarchicalStore, cache: KVCache, keys: list[str], chunk_blocks: int) -> int:
    """``keys`` into blocks ``0..N-1`` by a fresh worker with that chunk size (closed after):
    how many leading blocks it loaded."""
    worker = _worker(store, cache, chunk_blocks)
    try:
        return _load(worker, store, keys, tuple(range(N)))[0]
    finally:
        worker.close()


@pytest.mark.parametrize("readers", [1, 3])
def test_a_multi_chunk_lmdb_load_lands_the_bytes_of_the_unpipelined_path(
    lmdb_blocks: tuple[HierarchicalStore, KVCache, list[str]], readers: int
) -> None:
    """Whatever the chunking and however many reader threads split each chunk."""
    store, cache, keys = lmdb_blocks
    ids = tuple(random.Random(3).sample(range(2 * N + 2), N))
    landed = {}
    for chunk in (0, 3, 1, N):  # unpipelined, 4 chunks, one block a chunk, one chunk
        cache.tensor.zero_()
        worker = _worker(store, cache, chunk, readers=readers)
        try:
            n, copy_s, read_s = _load(worker, store, keys, ids)
        finally:
            worker.close()
        assert n == N and copy_s > 0 and read_s > 0, chunk
        landed[chunk] = cache.tensor.clone()
        assert store.stats()["load_pins"] == 0
    for chunk in (3, 1, N):
        assert torch.equal(landed[chunk].view(torch.uint8), landed[0].view(torch.uint8)), chunk
    others = [b for b in range(2 * N + 2) if b not in ids]
    assert bool((landed[3][others] == 0).all())


def test_a_pipelined_load_teaches_its_tier_and_not_the_host_link(
    lmdb_blocks: tuple[HierarchicalStore, KVCache, list[str]],
) -> None:
    """The pipeline's staging -> cache copies are paced by its reads (on CUDA their event
    spans hold the load thread's issuing gaps): the cost model learns the LMDB read from the
    load, and nothing about the host -> device hop; the load still reports its copy time."""
    store, cache, keys = lmdb_blocks
    model = RecordingCostModel()
    worker = _worker(store, cache, 3, cost_model=model)
    try:
        n, copy_s, read_s = _load(worker, store, keys, tuple(range(N)))
    finally:
        worker.close()
    assert n == N and copy_s > 0 and read_s > 0
    assert model.transfers == [("lmdb", N * cache.bytes_per_block)]


def test_a_pipelined_load_stops_at_the_first_missing_block(
    lmdb_blocks: tuple[HierarchicalStore, KVCache, list[str]],
) -> None:
    store, cache, keys = lmdb_blocks
    store.tiers[1].delete_many([keys[7]])  # in the third chunk
    assert _load_all(store, cache, keys, 3) == 7
    assert bool((cache.tensor[7:N] == 0).all()) and not bool((cache.tensor[6] == 0).all())


@pytest.mark.parametrize("bad", ["layout", "corrupt"])
def test_a_block_read_in_place_ends_the_load_when_its_layout_or_checksum_is_wrong(
    lmdb_blocks: tuple[HierarchicalStore, KVCache, list[str]], bad: str
) -> None:
    """The pipeline reads whole encoded blocks into its staging rows (``get_many_into``) on
    several reader threads; a block stored with another layout of the same size (dtype/shape
    in its header) or with a flipped byte ends the load there: never a wrong block copied."""
    store, cache, keys = lmdb_blocks
    if bad == "layout":  # the same bytes per block, another shape
        other = KVCache(KVCacheSpec(1, 4, 8, torch.float32), 2, "cpu")
        meta = block_meta(other, PREFIX)
        assert encoded_size(meta, keyed=True) == encoded_size(block_meta(cache, PREFIX), keyed=True)
        value = encode_block(bytes(cache.bytes_per_block), meta, key=keys[5])
    else:
        raw = bytearray(store.tiers[1].get_many([keys[5]])[0])  # type: ignore[arg-type]
        raw[len(raw) // 2] ^= 0xFF
        value = bytes(raw)
    store.tiers[1].put_many([(keys[5], value)])
    # blocks 4-7 in one chunk, split over reader threads
    assert _load_all(store, cache, keys, 4) == 5
    assert bool((cache.tensor[5:N] == 0).all()) and not bool((cache.tensor[4] == 0).all())


class _ThreadNoting(LoadPipeline):
    """Notes the thread each chunk is read on."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.read_on: list[str] = []

    def read_chunk(self, keys: tuple[str, ...], rows: torch.Tensor) -> int:
        self.read_on.append(threading.current_thread().name)
        return super().read_chunk(keys, rows)


@pytest.mark.parametrize("depth", [1, 2])
def test_with_two_slots_the_next_chunk_is_read_ahead_and_a_miss_stops_the_reads(
    lmdb_blocks: tuple[HierarchicalStore, KVCache, list[str]], depth: int
) -> None:
    """With two staging slots, chunk i + 1 is read on the read-ahead thread while chunk i's
    copies are issued (with one slot there is nowhere to read it into: every chunk is read
    on the load thread). The bytes are those of the unpipelined load either way; a missing
    block ends the load and the reads at its chunk."""
    store, cache, keys = lmdb_blocks
    cache.tensor.zero_()
    assert _load_all(store, cache, keys, 0) == N
    expected = cache.tensor.clone()
    headers = HeaderTemplate(block_meta(cache, PREFIX), keyed=True)
    for missing in (None, 7):
        if missing is not None:
            store.tiers[1].delete_many([keys[missing]])  # in the third chunk
        cache.tensor.zero_()
        pipe = _ThreadNoting(cache, store, None, chunk_blocks=3, depth=depth, headers=headers)
        try:
            piped = pipe.run(PipeJob(tuple(range(N)), tuple(keys)))
        finally:
            pipe.close()
        loaded = N if missing is None else missing
        assert piped.num_blocks == loaded and piped.read_s > 0
        assert torch.equal(cache.tensor[:loaded], expected[:loaded])
        assert bool((cache.tensor[loaded:] == 0).all())
        chunks = -(-(loaded + (missing is not None)) // 3)  # the chunk holding the miss is read
        assert len(pipe.read_on) == chunks, pipe.read_on
        ahead = [name.startswith("kvtier-load-ahead") for name in pipe.read_on]
        assert ahead == [False] + [depth > 1] * (chunks - 1), pipe.read_on


class _SlowPipeline(LoadPipeline):
    def read_chunk(self, keys: tuple[str, ...], rows: torch.Tensor) -> int:
        time.sleep(0.05)
        return super().read_chunk(keys, rows)


def test_a_cancelled_pipelined_load_stops_copying_and_releases_its_pins(
    lmdb_blocks: tuple[HierarchicalStore, KVCache, list[str]],
) -> None:
    store, cache, keys = lmdb_blocks
    worker = _worker(store, cache, 1)
    loader = worker._loader
    loader._pipeline = _SlowPipeline(cache, store, None, chunk_blocks=1, depth=2)
    try:
        spec = store.prepare_load(keys)
        load = BlockLoad("r", tuple(range(N)), tuple(keys), 0, ("lmdb",) * N, spec=spec)
        worker.start_load_kv(KVConnectorMetadata(loads=(load,), num_scheduled_requests=1))
        time.sleep(0.12)  # two or three chunks read
        worker.start_load_kv(
            KVConnectorMetadata(cancelled_loads=frozenset({"r"}), num_scheduled_requests=1)
        )
        snapshot = cache.tensor.clone()  # no copy after the cancel returned
        time.sleep(0.2)
        assert torch.equal(snapshot, cache.tensor)
        assert 0 < int((cache.tensor.view(N + N + 2, -1) != 0).any(dim=1).sum()) < N
        assert worker.take_report().finished_loads == ()
    finally:
        worker.close()
    assert store.stats()["load_pins"] == 0


def test_pipeline_knobs_are_checked() -> None:
    assert chunk_blocks_for(0, 1024) == 0 and chunk_blocks_for(100, 1024) == 1
    assert chunk_blocks_for(16 << 20, 2 << 20) == 8
    tiers = [{"kind": "host", "capacity": "1MiB"}]
    assert parse_offload_config({"tiers": tiers}).load_chunk_bytes == 64 << 20
    assert parse_offload_config({"tiers": tiers}).load_read_threads == 0
    assert parse_offload_config({"tiers": tiers, "load_read_threads": 3}).load_read_threads == 3
    assert pipeline_readers(3) == 3 and 1 <= pipeline_readers() <= READ_THREADS
    # a size with its unit, as tier capacities take (a user's `64MiB` was refused before)
    for given, want in (("64MiB", 64 << 20), ("16MB", 16 * 10**6), (1 << 20, 1 << 20), (0, 0)):
        config = parse_offload_config({"tiers": tiers, "load_chunk_bytes": given})
        assert config.load_chunk_bytes == want
    for bad in (
        {"load_chunk_bytes": -1},
        {"load_pipeline_depth": 0},
        {"load_chunk_bytes": "big"},
        {"load_chunk_bytes": "32blocks"},
        {"load_chunk_bytes": 1.5},
        {"load_read_threads": -1},
    ):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            parse_offload_config({"tiers": tiers, **bad})


GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("chunk_bytes", [0, 2 * 8192])
def test_greedy_tokens_with_a_pipelined_lmdb_reload_equal_those_without_offload(
    model_dir: str, tmp_path: Path, chunk_bytes: int
) -> None:
    """One engine writes a prompt's blocks down to LMDB (closing flushes them); a restarted one
    (an empty host tier above the same LMDB) reloads them through the pipeline in chunks of 2
    blocks (0: unpipelined) and gives the tokens of an engine without offload. The pipelined
    read promotes nothing, and the blocks are in the host tier once the request is done."""
    rng = random.Random(9)
    prompt = [rng.randrange(3, VOCAB) for _ in range(120)]
    want = list(make_llm(model_dir, 10).generate([prompt], GREEDY)[0].token_ids)
    config = {
        "decision": "load",
        "calibrate": False,
        "load_chunk_bytes": chunk_bytes,
        "tiers": [
            {"kind": "host", "capacity": f"{16 * SLOT}B"},
            {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"},
        ],
    }
    with make_llm(model_dir, 10, config) as llm:
        assert list(llm.generate([prompt], GREEDY)[0].token_ids) == want
    log = tmp_path / "requests.jsonl"
    with make_llm(model_dir, 10, config, request_log=str(log)) as llm:
        assert list(llm.generate([prompt], GREEDY)[0].token_ids) == want
        store = llm.engine.kv_connector.store
        promoted = store.stats()
        llm.engine.flush_kv()
        kv = llm.kv_stats()
        host_keys = set(store.tiers[0].lru_keys())
    host_stats = next(t for t in promoted["tiers"] if t["name"] == "host")
    if chunk_bytes:
        # The pipelined read promotes nothing (no second copy of each block on the read path);
        # the blocks reach the host tier through the saves once the request frees them.
        assert host_stats["promotions"] == 0
    assert len(host_keys) == 7
    assert kv["tiers"]["lmdb"]["hit_blocks"] == 7 and kv["failed_loads"] == 0
    assert kv["loaded_tokens"] == 7 * 16
    row = json.loads(log.read_text().splitlines()[-1])  # the load's measured parts
    assert row["hit_tiers"] == ["lmdb"] * 7 and row["decision"] == "load_prefix"
    assert row["kv_load_s"]["read"] > 0 and row["kv_load_s"]["copy"] > 0
    assert row["ttft_breakdown_s"]["load"] >= row["kv_load_s"]["copy"]


@pytest.mark.gpu
def test_a_pipelined_load_on_cuda_lands_the_bytes_and_times_its_copies(tmp_path: Path) -> None:
    """CUDA: the load thread's copies on the side stream (events timed, read after they
    completed) land what the serial path lands."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    cache = KVCache(spec, 2 * N + 2, "cuda")
    meta = block_meta(cache, PREFIX)
    store = _store(tmp_path, encoded_size(meta, keyed=True), host_slots=2)
    gen = torch.Generator().manual_seed(6)
    keys = [f"{PREFIX}/{i:02x}" for i in range(N)]
    payload = torch.randint(0, 255, (N, cache.bytes_per_block), generator=gen, dtype=torch.uint8)
    store.tiers[1].put_many(
        [(k, encode_block(payload[i].numpy().tobytes(), meta, key=k)) for i, k in enumerate(keys)]
    )
    ids = tuple(range(1, 2 * N + 1, 2))
    try:
        for chunk in (0, 3):
            cache.tensor.zero_()
            worker = _worker(store, cache, chunk)
            try:
                n, copy_s, _ = _load(worker, store, keys, ids)
            finally:
                worker.close()
            assert n == N and copy_s > 0
            assert torch.equal(cache.byte_rows()[list(ids)].cpu(), payload), chunk
    finally:
        store.close()


def test_the_staging_ring_is_ready_before_the_first_load(
    lmdb_blocks: tuple[HierarchicalStore, KVCache, list[str]],
) -> None:
    """The load thread allocates (and on CPU touches) the ring when the worker starts, so the
    first lower-tier reload of an engine (e.g. right after a restart) does not pay for it."""
    store, cache, keys = lmdb_blocks
    worker = _worker(store, cache, 3)
    try:
        loader = worker._loader
        loader._pool.submit(lambda: None).result()  # the load thread's queue so far
        ring = loader._pipeline._ring  # type: ignore[union-attr]
        assert ring is not None and tuple(ring.shape)[0] == 2 * 3
        assert not bool(ring.any())
        before = ring.data_ptr()
        assert _load(worker, store, keys, tuple(range(N)))[0] == N
        assert loader._pipeline._ring.data_ptr() == before  # type: ignore[union-attr]
    finally:
        worker.close()


def test_lmcache_environment_is_named_not_read() -> None:
    from connectors.offload.config import lmcache_settings_note

    assert lmcache_settings_note({"HOME": "/root"}) is None
    note = lmcache_settings_note(
        {"LMCACHE_CONFIG_FILE": "/etc/lmc.yaml", "LMCACHE_CHUNK_SIZE": "256"}
    )
    assert note is not None and "\n" not in note
    assert "LMCACHE_CHUNK_SIZE, LMCACHE_CONFIG_FILE set" in note and "does not read" in note
    many = {f"LMCACHE_X{i}": "1" for i in range(6)}
    assert "and 2 more" in (lmcache_settings_note(many) or "")
