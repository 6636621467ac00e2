"""The cache daemon: ops end to end over a real ZMQ socket, the shm path, admin port, CLI, drain."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq

from cachestore.server.admin import METRIC_NAMES, AdminMetrics, AdminServer, create_app
from cachestore.server.daemon import CacheServer, ServerConfig
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from tests.cachestore.server.daemon_procs import ROOT, spawn_daemon
from tests.cachestore.store_helpers import sized_block
from tests.servers import free_port
from tiers.host import HostTier
from tiers.lmdb import LmdbTier
from tiers.remote.protocol import PROTOCOL_VERSION, checksum
from tiers.remote.tier import RemoteTier
from tiers.remote.zap import secure_client


@pytest.fixture
def server(tmp_path: Path) -> Iterator[CacheServer]:
    backend = HierarchicalStore(
        [HostTier(8 << 20, 256 << 10, pin_memory=False), LmdbTier(tmp_path / "lmdb", 64 << 20)],
        StoreConfig(write_through_to=1),
    )
    metrics = AdminMetrics()
    srv = CacheServer(
        ServerConfig(url="tcp://127.0.0.1:0", access_log_path=str(tmp_path / "access.jsonl")),
        backend,
        on_request=metrics.record,
    )
    metrics.bind(srv)
    srv.metrics = metrics  # type: ignore[attr-defined]
    srv.start()
    yield srv
    srv.stop()
    backend.close()


def _shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("kvtier-")}


@pytest.mark.parametrize("use_shm", [False, True])
def test_round_trip_lookup_delete_stats(server: CacheServer, use_shm: bool) -> None:
    before = _shm_names()
    tier = RemoteTier(server.bound_url, use_shm=use_shm, timeout_s=5, batch_keys=7)
    keys = [f"ns0/{i:032x}" for i in range(20)]  # 3 pipelined requests per batch
    items = [(k, sized_block(k, 1000 + 37 * i)) for i, k in enumerate(keys)]
    assert tier.put_many(items) == []
    assert tier.lookup(keys) == 20
    assert tier.lookup(keys[:9] + ["ns0/absent"] + keys[9:]) == 9
    got = tier.get_many(keys + ["ns0/absent"])
    assert [bytes(v) for v in got[:20]] == [v for _, v in items]
    assert got[20] is None
    usage = tier.usage()
    assert (usage.used_bytes, usage.num_entries) == (sum(len(v) for _, v in items), 20)
    assert tier.delete_many(keys[:5] + ["ns0/absent"]) == 5
    assert tier.lookup(keys) == 0 and tier.lookup(keys[5:]) == 15
    assert tier.usage().num_entries == 15
    # The path really taken shows up in the byte counters of the metrics.
    text = server.metrics.exposition().decode()  # type: ignore[attr-defined]
    path = "shm" if use_shm else "tcp"
    assert f'kvtier_server_bytes_total{{op="get",path="{path}"}}' in text
    tier.close()
    assert _shm_names() == before  # nothing left in /dev/shm, even while the daemon runs


def test_shm_segment_grows_for_large_batches(server: CacheServer) -> None:
    tier = RemoteTier(server.bound_url, use_shm=True, shm_bytes=1 << 20, timeout_s=5)
    items = [
        (k, sized_block(k, 200_000)) for k in (f"ns0/{i:04x}" for i in range(12))
    ]  # 2.4 MB > 1 MiB
    tier.put_many(items)
    first = [bytes(v) for v in tier.get_many([k for k, _ in items])]  # partly over frames
    second = [bytes(v) for v in tier.get_many([k for k, _ in items])]  # grown: all via shm
    assert first == second == [v for _, v in items]
    tier.close()


def test_access_log_is_jsonl(server: CacheServer, tmp_path: Path) -> None:
    tier = RemoteTier(server.bound_url, use_shm=False)
    tier.put_many([("ns1/aa", sized_block("ns1/aa", 100))])
    tier.get_many(["ns1/aa", "ns1/bb"])
    tier.close()
    server.stop()
    lines = [json.loads(x) for x in (tmp_path / "access.jsonl").read_text().splitlines()]
    assert [(r["op"], r["namespace"], r["keys"]) for r in lines] == [
        ("put", "default", ["ns1/aa"]),
        ("get", "default", ["ns1/aa", "ns1/bb"]),
    ]
    assert lines[1]["hits"] == 1 and all(isinstance(r["ts"], float) for r in lines)


def test_admin_endpoints(server: CacheServer) -> None:
    port = free_port()
    admin = AdminServer(create_app(server, server.metrics), "127.0.0.1", port).start()  # type: ignore[attr-defined]
    try:
        tier = RemoteTier(server.bound_url, use_shm=False)
        tier.put_many(
            [("ns2/01", sized_block("ns2/01", 100)), ("ns2/02", sized_block("ns2/02", 250))]
        )
        tier.get_many(["ns2/01", "ns2/99"])
        tier.close()
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while not admin.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(f"{base}/health").json()["status"] == "ok"
        stats = httpx.get(f"{base}/stats").json()
        assert stats["namespaces"] == {"default": {"bytes": 350, "keys": 2}}
        assert stats["tier_usage"]["lmdb"]["num_entries"] == 2  # written through
        assert [t["name"] for t in stats["store"]["tiers"]] == ["host", "lmdb"]
        metrics = httpx.get(f"{base}/metrics").text
        assert 'kvtier_server_requests_total{code="OK",op="put"} 1.0' in metrics
        assert 'kvtier_server_keys_total{op="get",result="hit"} 1.0' in metrics
        assert 'kvtier_server_keys_total{op="get",result="miss"} 1.0' in metrics
        assert 'kvtier_server_namespace_bytes{namespace="default"} 350.0' in metrics
        assert 'kvtier_tier_entries{tier="host"} 2.0' in metrics
        assert "kvtier_server_lent_bytes 0.0" in metrics  # every lent block came back
        assert "kvtier_server_leased_bytes 0.0" in metrics  # and every lease
        for name in METRIC_NAMES:
            assert name in metrics
    finally:
        admin.stop()


def test_raw_protocol_reply_shape(server: CacheServer) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    secure_client(sock, None)
    sock.connect(server.bound_url)
    blk = sized_block("p/01", 100)
    header = {
        "v": PROTOCOL_VERSION,
        "id": 41,
        "op": "put",
        "token": "",
        "keys": ["p/01"],
        "sizes": [100],
        "checksums": [checksum(blk)],
    }
    sock.send_multipart([msgpack.packb(header), blk])
    assert sock.poll(5000)
    reply = msgpack.unpackb(sock.recv_multipart()[0])
    assert reply == {"id": 41, "code": 0, "error": "", "stored": 1, "raced": 0, "evicted": 0}
    sock.send_multipart([msgpack.packb({**header, "id": 42, "op": "get", "sizes": None})])
    assert sock.poll(5000)
    frames = sock.recv_multipart()
    assert msgpack.unpackb(frames[0])["sizes"] == [100] and frames[1:] == [blk]
    sock.close(0)


def _spawn(args: list[str]) -> subprocess.Popen[str]:
    return spawn_daemon(*args)


def test_cli_refuses_public_bind_without_tokens(tmp_path: Path) -> None:
    proc = _spawn(
        ["--host", "0.0.0.0", "--port", "0", "--admin-port", "-1", "--data-dir", str(tmp_path)]
    )
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "without --tokens" in err


def test_cli_sigterm_drains_and_cleans_up(tmp_path: Path) -> None:
    port = free_port()
    proc = _spawn(["--port", str(port), "--admin-port", "-1", "--data-dir", str(tmp_path)])
    assert proc.stdout is not None
    assert "listening on" in proc.stdout.readline()
    before = _shm_names()
    tier = RemoteTier(f"tcp://127.0.0.1:{port}", timeout_s=5)
    tier.put_many([("ns/01", sized_block("ns/01", 1000))])
    assert bytes(tier.get_many(["ns/01"])[0]) == sized_block("ns/01", 1000)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "stopped" in out
    tier.close()
    assert _shm_names() == before


def test_loop_cpu_pins_the_loop_thread_only(tmp_path: Path) -> None:
    """``loop_cpu``: the loop thread runs on that CPU alone; pool threads it spawns do not
    inherit the pin; a CPU outside the process's set is refused up front."""
    import threading

    cpus = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match="loop_cpu"):
        ServerConfig(url="tcp://127.0.0.1:0", loop_cpu=max(cpus) + 1000)
    cpu = min(cpus)
    store = HierarchicalStore([LmdbTier(tmp_path / "lmdb", 64 << 20)], StoreConfig())
    srv = CacheServer(ServerConfig(url="tcp://127.0.0.1:0", loop_cpu=cpu), store).start()
    tier = RemoteTier(srv.bound_url, use_shm=False)
    try:
        key = "abcd/" + "5" * 40
        tier.put_many([(key, sized_block(key, 5000))])  # the pool runs it: a worker exists
        assert bytes(tier.get_many([key])[0]) == sized_block(key, 5000)
        threads = {t.name: t.native_id for t in threading.enumerate()}
        loop = threads["kvtier-cache-server"]
        workers = [tid for name, tid in threads.items() if name.startswith("kvtier-worker")]
        assert loop is not None and workers
        assert os.sched_getaffinity(loop) == {cpu}
        assert all(os.sched_getaffinity(tid) == cpus for tid in workers if tid is not None)
    finally:
        tier.close()
        srv.stop()
        store.close()


def test_admin_port_loopback_by_default_and_token_when_exposed(
    server: CacheServer, tmp_path: Path
) -> None:
    """Issue 16 F6: the admin port binds loopback unless told otherwise, refuses another
    address without a token, and with one answers tenant data only to its bearer."""
    cli = [
        sys.executable,
        "-m",
        "engine.cli",
        "cache-server",
        "--port",
        "0",
        "--host-capacity",
        "4MiB",
        "--no-stream",
        "--no-doorbell",
    ]
    exposed = subprocess.run(
        [*cli, "--admin-host", "0.0.0.0", "--admin-port", str(free_port())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert exposed.returncode == 2 and "--admin-token-file" in exposed.stderr
    short = tmp_path / "short"
    short.write_text("abc\n")
    refused = subprocess.run(
        [*cli, "--admin-token-file", str(short)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "at least 16" in refused.stderr
    port = free_port()
    proc = subprocess.Popen(
        [*cli, "--admin-port", str(port)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert f"admin http://127.0.0.1:{port}" in proc.stdout.readline()
    finally:
        proc.terminate()
        proc.wait(30)
    port = free_port()
    token = "t0k-admin-0123456789"
    admin = AdminServer(
        create_app(server, server.metrics, token),  # type: ignore[attr-defined]
        "127.0.0.1",
        port,
    ).start()
    try:
        deadline = time.monotonic() + 10
        while not admin.started and time.monotonic() < deadline:
            time.sleep(0.02)
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/health").status_code == 200  # probes need no token
        for path in ("/stats", "/namespaces", "/metrics", "/docs", "/openapi.json"):
            assert httpx.get(f"{base}{path}").status_code == 401, path
            wrong = {"Authorization": "Bearer nope"}
            assert httpx.get(f"{base}{path}", headers=wrong).status_code == 401, path
        good = {"Authorization": f"Bearer {token}"}
        assert httpx.get(f"{base}/namespaces", headers=good).status_code == 200
        assert "kvtier_server_requests_total" in httpx.get(f"{base}/metrics", headers=good).text
    finally:
        admin.stop()


def test_put_race_is_counted_not_internal(server: CacheServer) -> None:
    """Issue 16 F7: a put key another request is writing is left to that request and counted
    (kvtier_server_put_races_total); a put whose every key raced is PUT_RACED, which the
    client takes as done, not INTERNAL."""
    from tiers.remote.protocol import ErrorCode

    keys = ["ns9/aa", "ns9/bb"]
    blocks = [sized_block(k, 300) for k in keys]
    claims = server.handler.put_claims
    held = claims.claim(["default/ns9/aa"])  # a concurrent put of ns9/aa is in flight
    tier = RemoteTier(server.bound_url, use_shm=False)
    try:
        assert tier.put_many(list(zip(keys, blocks, strict=True))) == []
        assert tier.lookup(["ns9/bb"]) == 1 and tier.lookup(["ns9/aa"]) == 0
        assert tier.put_many([("ns9/aa", blocks[0])]) == []  # every key raced: no error
        sock = zmq.Context.instance().socket(zmq.DEALER)
        secure_client(sock, None)
        sock.connect(server.bound_url)
        header = {
            "v": PROTOCOL_VERSION,
            "id": 5,
            "op": "put",
            "token": "",
            "keys": ["ns9/aa"],
            "sizes": [300],
            "checksums": [checksum(blocks[0])],
        }
        sock.send_multipart([msgpack.packb(header), blocks[0]])
        assert sock.poll(5000)
        reply = msgpack.unpackb(sock.recv_multipart()[0])
        sock.close(0)
        assert reply["code"] == ErrorCode.PUT_RACED and "concurrent" in reply["error"]
        claims.release(["default/ns9/aa"], held)
        assert tier.put_many([("ns9/aa", blocks[0])]) == [] and tier.lookup(["ns9/aa"]) == 1
    finally:
        tier.close()
    text = server.metrics.exposition().decode()  # type: ignore[attr-defined]
    assert "kvtier_server_put_races_total 3.0" in text
    assert 'kvtier_server_requests_total{code="PUT_RACED",op="put"} 2.0' in text
    assert 'code="INTERNAL"' not in text
