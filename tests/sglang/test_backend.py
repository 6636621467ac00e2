"""kvtier's HiCache backend inside SGLang's own storage API (sglang 0.5.23, CPU): built by
SGLang's ``StorageBackendFactory`` (backend ``dynamic``) from a real ``HiCacheStorageConfig``,
keyed by SGLang's own page hashes; pages round-trip byte-exact through LMDB and a real
``kvtier cache-server``, on the zero-copy (``interface_v1``) and the generic paths; a corrupt
or foreign page is a miss; counters and SGLang's ``StorageMetrics``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage import StorageBackendFactory

from connectors.sglang.storage import KvtierHiCacheStorage
from tests.servers import cache_server_process
from tests.sglang.helpers import (
    indices,
    make_backend,
    page_bytes,
    page_keys,
    storage_config,
)
from tests.sglang.host_pool import HostPoolStandIn

TOKEN = "sglang-test-token"
N = 6  # pages a test stores


def _lmdb(tmp_path: Path) -> dict[str, Any]:
    return {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"}


def _round_trip(backend: HiCacheStorage, src: HostPoolStandIn, dst: HostPoolStandIn) -> None:
    keys = page_keys(N)
    # stored from pool pages 2..7, read back into pages 8..13 of another pool
    assert backend.batch_set_v1(keys, indices(2, N)) == [True] * N
    assert backend.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == N
    assert backend.batch_get_v1(keys, indices(8, N)) == [True] * N
    for p in range(N):
        assert page_bytes(dst, 8 + p) == page_bytes(src, 2 + p)


@pytest.mark.parametrize(
    "layout,mla", [("page_first", False), ("layer_first", False), ("page_first", True)]
)
def test_pages_round_trip_byte_exact_through_lmdb(tmp_path, layout, mla):
    pool = HostPoolStandIn(layout, mla=mla)
    pool.fill_random(1)
    backend = make_backend([_lmdb(tmp_path)], pool)
    assert type(backend) is KvtierHiCacheStorage  # SGLang's factory built ours, unwrapped
    try:
        _round_trip(backend, pool, pool)
        assert backend.stats()["counters"]["get_hits"] == N
    finally:
        backend.close()


def test_pages_round_trip_byte_exact_through_the_cache_server(tmp_path):
    src, dst = HostPoolStandIn(), HostPoolStandIn()
    src.fill_random(2)
    with cache_server_process(tmp_path, TOKEN, "sglang") as port:
        remote = {"kind": "remote", "url": f"tcp://127.0.0.1:{port}", "token": TOKEN}
        writer = make_backend([remote], src)
        reader = make_backend([remote], dst)
        try:
            keys = page_keys(N)
            assert writer.batch_set_v1(keys, indices(2, N)) == [True] * N
            assert reader.batch_get_v1(keys, indices(8, N)) == [True] * N
            assert [page_bytes(dst, 8 + p) for p in range(N)] == [
                page_bytes(src, 2 + p) for p in range(N)
            ]
            remote_row = next(t for t in reader.stats()["store"]["tiers"])
            assert remote_row["hits"] == N
        finally:
            writer.close()
            reader.close()


def test_the_generic_and_zero_copy_paths_store_the_same_bytes(tmp_path):
    """SGLang's generic path (flat page tensors) and the zero-copy one (page pointers) read
    each other's pages: the pointer segments are gathered in the flat page's order."""
    for layout in ("page_first", "layer_first"):
        pool = HostPoolStandIn(layout)
        pool.fill_random(3)
        backend = make_backend([_lmdb(tmp_path / layout)], pool)
        try:
            keys = page_keys(N, seed=3)
            flat = [pool.get_data_page(4 * (2 + p)) for p in range(N)]
            assert backend.batch_set(keys, flat) is True
            assert backend.batch_get_v1(keys, indices(8, N)) == [True] * N
            assert [page_bytes(pool, 8 + p) for p in range(N)] == [
                page_bytes(pool, 2 + p) for p in range(N)
            ]
            targets = [pool.get_dummy_flat_data_page() for _ in keys]
            got = backend.batch_get(keys, targets)
            assert all(torch.equal(g, f) for g, f in zip(got, flat, strict=True))
            assert backend.get("0" * 64, pool.get_dummy_flat_data_page()) is None
        finally:
            backend.close()


def test_a_corrupt_or_foreign_page_is_a_miss(tmp_path):
    pool = HostPoolStandIn()
    pool.fill_random(4)
    backend = make_backend([_lmdb(tmp_path)], pool)
    try:
        keys = page_keys(3, seed=4)
        assert backend.batch_set_v1(keys, indices(0, 3)) == [True] * 3
        store, skeys = backend.store, backend._keys(keys)
        blocks = store.get_many_encoded(skeys)
        corrupt = bytearray(blocks[0])
        corrupt[len(corrupt) // 2] ^= 0x01  # one payload bit: the checksum fails
        store.delete_many(skeys[:2])
        # page 0 corrupt; page 1 holds page 2's block (another key): both are misses
        store.put_many([(skeys[0], bytes(corrupt)), (skeys[1], bytes(blocks[2]))])
        assert backend.batch_get_v1(keys, indices(8, 3)) == [False, False, True]
        lmdb = store.stats()["tiers"][0]
        assert lmdb["corrupt"] >= 2 and lmdb["wrong_key"] >= 1
        assert backend.stats()["counters"]["get_misses"] == 2
    finally:
        backend.close()


def test_another_layout_never_reads_these_pages(tmp_path):
    """Same model and keys, another page layout: another namespace, so no hit."""
    a, b = HostPoolStandIn("page_first"), HostPoolStandIn("layer_first")
    a.fill_random(5)
    backend = make_backend([_lmdb(tmp_path)], a)
    keys = page_keys(N, seed=5)
    try:
        assert backend.batch_set_v1(keys, indices(0, N)) == [True] * N
    finally:
        backend.close()
    other = make_backend([_lmdb(tmp_path)], b)
    try:
        assert other.batch_exists(keys) == 0
        assert other.batch_get_v1(keys, indices(0, N)) == [False] * N
    finally:
        other.close()


def test_write_through_copies_pages_from_the_host_tier_to_lmdb(tmp_path):
    pool = HostPoolStandIn()
    pool.fill_random(6)
    host = {"kind": "host", "capacity": "1MiB"}
    backend = make_backend([host, {**_lmdb(tmp_path), "write_policy": "write_through"}], pool)
    try:
        keys = page_keys(N, seed=6)
        assert backend.batch_set_v1(keys, indices(0, N)) == [True] * N
        backend.store.flush(write_timeout_s=10)
        host_row, lmdb_row = backend.store.stats()["tiers"]
        assert host_row["bytes_written"] > 0 and lmdb_row["written_through"] == N
        assert backend.store.tiers[1].contains_many(backend._keys(keys)) == [True] * N
        # the second write of the same pages is skipped: they are stored
        assert backend.batch_set_v1(keys, indices(0, N)) == [True] * N
        assert backend.stats()["counters"]["set_present"] == N
    finally:
        backend.close()


def test_metrics_are_sglangs_storage_metrics_and_kvtiers_counters(tmp_path):
    pool = HostPoolStandIn()
    backend = make_backend([_lmdb(tmp_path)], pool)
    try:
        keys = page_keys(N, seed=7)
        backend.batch_set_v1(keys, indices(0, N))
        backend.batch_get_v1(keys, indices(8, N))
        m = backend.get_stats()
        assert m.backup_pgs == [N] and m.prefetch_pgs == [N]
        assert m.prefetch_bandwidth[0] > 0 and backend.get_stats().prefetch_pgs == []
        c = backend.stats()["counters"]
        assert (c["set_written"], c["get_hits"], c["get_misses"]) == (N, N, 0)
        assert c["get_bytes"] == N * pool.get_dummy_flat_data_page().numel() * 2
    finally:
        backend.close()


def test_bad_extra_config_is_a_one_line_error():
    cfg = storage_config([], kvtier_config="/nonexistent/tiers.yaml", oops=1)
    with pytest.raises(ValueError, match="unknown key.*oops") as err:
        StorageBackendFactory.create_backend("dynamic", cfg, None)
    assert "\n" not in str(err.value)
    cfg = storage_config([])
    cfg.extra_config.pop("tiers")
    with pytest.raises(ValueError, match="needs 'kvtier_config'"):
        StorageBackendFactory.create_backend("dynamic", cfg, None)
