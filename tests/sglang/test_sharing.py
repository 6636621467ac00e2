"""What SGLang instances share through kvtier: a second process finds what the first stored
(the cache server), a restarted backend finds LMDB's pages, a Redis that dies degrades to
misses (real redis-server, SIGKILLed), TP ranks never see each other's pages (MLA ranks
share theirs). All through SGLang's ``StorageBackendFactory`` with backend ``dynamic``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.servers import cache_server_process
from tests.sglang.helpers import indices, make_backend, page_bytes, page_keys
from tests.sglang.host_pool import HostPoolStandIn

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "sglang-share-token"
N = 5


def _remote(port: int) -> dict[str, object]:
    return {"kind": "remote", "url": f"tcp://127.0.0.1:{port}", "token": TOKEN}


def test_a_second_process_finds_what_the_first_stored(tmp_path):
    pool = HostPoolStandIn()
    pool.fill_random(11)
    with cache_server_process(tmp_path, TOKEN, "sglang") as port:
        backend = make_backend([_remote(port)], pool)
        try:
            assert backend.batch_set_v1(page_keys(N, seed=11), indices(0, N)) == [True] * N
        finally:
            backend.close()
        spec = tmp_path / "peer.json"
        spec.write_text(json.dumps({"tiers": [_remote(port)], "num_pages": N, "seed": 11}))
        proc = subprocess.run(
            [sys.executable, "-m", "tests.sglang.peer", str(spec)],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["exists"] == N and out["got"] == [True] * N
    assert out["pages"] == [page_bytes(pool, p).hex() for p in range(N)]


def test_a_restarted_backend_finds_lmdbs_pages(tmp_path):
    lmdb = {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"}
    host = {"kind": "host", "capacity": "1MiB"}
    pool = HostPoolStandIn()
    pool.fill_random(12)
    keys = page_keys(N, seed=12)
    first = make_backend([host, lmdb], pool)
    assert first.batch_set_v1(keys, indices(0, N)) == [True] * N
    first.close()  # drains the write-through copies to LMDB
    fresh = HostPoolStandIn()
    again = make_backend([host, lmdb], fresh)
    try:
        assert again.batch_exists(keys) == N
        assert again.batch_get_v1(keys, indices(0, N)) == [True] * N
        assert [page_bytes(fresh, p) for p in range(N)] == [page_bytes(pool, p) for p in range(N)]
        host_row, lmdb_row = again.store.stats()["tiers"]
        assert lmdb_row["hits"] == N and host_row["hits"] == 0
    finally:
        again.close()


def test_a_redis_that_dies_degrades_to_misses(redis_server, redis_url):
    rds = {
        "kind": "redis",
        "url": redis_url,
        "socket_timeout_s": 0.5,
        "connect_timeout_s": 0.5,
        "retries": 0,
    }
    pool = HostPoolStandIn()
    pool.fill_random(13)
    keys = page_keys(N, seed=13)
    backend = make_backend([rds], pool)
    try:
        assert backend.batch_set_v1(keys, indices(0, N)) == [True] * N
        assert backend.batch_get_v1(keys, indices(8, N)) == [True] * N
        redis_server.kill()
        t0 = time.monotonic()
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, indices(8, N)) == [False] * N
        assert backend.batch_set_v1(page_keys(2, seed=99), indices(0, 2)) == [False, False]
        assert time.monotonic() - t0 < 10  # timeouts and backoff, not hangs
        row = backend.store.stats()["tiers"][0]
        assert row["errors"] + row["skipped"] >= 1
    finally:
        backend.close()
        redis_server.ensure_running()


def test_tp_ranks_never_see_each_others_pages_and_mla_ranks_share(tmp_path):
    keys = page_keys(N, seed=14)
    with cache_server_process(tmp_path, TOKEN, "sglang") as port:
        pools = [HostPoolStandIn(), HostPoolStandIn()]
        ranks = [make_backend([_remote(port)], pools[r], tp_rank=r, tp_size=2) for r in (0, 1)]
        try:
            pools[0].fill_random(140)
            assert ranks[0].batch_set_v1(keys, indices(0, N)) == [True] * N
            assert ranks[1].batch_exists(keys) == 0  # the same SGLang keys, another shard
            assert ranks[1].batch_get_v1(keys, indices(0, N)) == [False] * N
            pools[1].fill_random(141)
            assert ranks[1].batch_set_v1(keys, indices(0, N)) == [True] * N
            for r in (0, 1):
                expect = [page_bytes(pools[r], p) for p in range(N)]
                assert ranks[r].batch_get_v1(keys, indices(8, N)) == [True] * N
                assert [page_bytes(pools[r], 8 + p) for p in range(N)] == expect
            assert ranks[0].namespace.key_prefix() != ranks[1].namespace.key_prefix()
        finally:
            for b in ranks:
                b.close()
        mla = [HostPoolStandIn(mla=True), HostPoolStandIn(mla=True)]
        mla[0].fill_random(142)
        ranks = [make_backend([_remote(port)], mla[r], tp_rank=r, tp_size=2) for r in (0, 1)]
        try:
            assert ranks[0].batch_set_v1(keys, indices(0, N)) == [True] * N
            assert ranks[1].batch_get_v1(keys, indices(0, N)) == [True] * N  # replicated KV
            assert [page_bytes(mla[1], p) for p in range(N)] == [
                page_bytes(mla[0], p) for p in range(N)
            ]
        finally:
            for b in ranks:
                b.close()
