"""R4: hostile input gets a clear error and never crashes the daemon or crosses tenants.

The soak test runs 16 clients against a daemon process and bounds its anonymous RSS; its
duration is ``--server-soak-s`` (tests/conftest.py; default 5, or KVTIER_SERVER_SOAK_S).
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from cachestore.codec import BlockMeta, encode_block
from cachestore.server.daemon import CacheServer, ServerConfig
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from tests.cachestore.server.daemon_procs import ROOT, proc_status_kib
from tests.servers import free_port
from tiers.base import TierError
from tiers.lmdb import LmdbTier
from tiers.remote import shm
from tiers.remote.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    ServerLimits,
    TokenTable,
    checksum,
    split_frames,
    zmq_max_frames,
)
from tiers.remote.tier import RemoteTier
from tiers.remote.zap import secure_client

TOKENS = """# token namespace [key prefixes]
tok-alice-0001 alice
tok-bob-000002 bob
tok-carol-0003 carol aaaa bbbb
"""
LIMITS = ServerLimits(max_keys_per_request=32, max_frame_bytes=1 << 20, max_namespace_bytes=4 << 20)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[CacheServer]:
    backend = HierarchicalStore([LmdbTier(tmp_path / "lmdb", 64 << 20)], StoreConfig())
    srv = CacheServer(
        ServerConfig(url="tcp://127.0.0.1:0", limits=LIMITS), backend, TokenTable.parse(TOKENS)
    ).start()
    yield srv
    srv.stop()
    backend.close()


class Raw:
    """A bare DEALER socket that sends whatever frames a test wants."""

    def __init__(self, url: str, token: str = "tok-alice-0001") -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_client(self.sock, token)  # the connection's token; each request has its own
        self.sock.connect(url)

    def ask(
        self, frames: list[bytes], timeout_ms: int = 5000
    ) -> tuple[dict[str, Any], list[bytes]]:
        self.sock.send_multipart(frames)
        assert self.sock.poll(timeout_ms), "no reply"
        reply = self.sock.recv_multipart()
        return msgpack.unpackb(reply[0]), reply[1:]

    def op(self, payloads: list[bytes] | None = None, **header: Any) -> dict[str, Any]:
        full = {"v": PROTOCOL_VERSION, "id": 7, "token": "tok-alice-0001", **header}
        # As the real client does: a payload over ZMQ_FRAME_BYTES goes as several frames.
        return self.ask([msgpack.packb(full), *split_frames(payloads or [])])[0]


def _block(key: str, payload: bytes) -> bytes:
    """``payload`` as an encoded block of ``key``'s namespace (what the daemon accepts)."""
    ns = key.split("/", 1)[0]
    return encode_block(payload, BlockMeta("uint8", (len(payload),), "test", ns))


def _put(raw: Raw, token: str, keys: list[str], values: list[bytes]) -> dict[str, Any]:
    return raw.op(
        values,
        op="put",
        token=token,
        keys=keys,
        sizes=[len(v) for v in values],
        checksums=[checksum(v) for v in values],
    )


@pytest.mark.parametrize(
    "frames, code, needle",
    [
        ([b"\xc1garbage"], ErrorCode.BAD_HEADER, "not msgpack"),
        ([msgpack.packb([1, 2, 3])], ErrorCode.BAD_HEADER, "must be a msgpack map"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "op": "get"})], ErrorCode.BAD_HEADER, "'id'"),
        ([msgpack.packb({"v": 99, "id": 1, "op": "get"})], ErrorCode.BAD_VERSION, "version"),
        (
            [msgpack.packb({"v": PROTOCOL_VERSION, "id": 1, "op": "drop_all"})],
            ErrorCode.UNKNOWN_OP,
            "drop_all",
        ),
        (
            [
                msgpack.packb(
                    {
                        "v": PROTOCOL_VERSION,
                        "id": 1,
                        "op": "get",
                        "token": "tok-alice-0001",
                        "keys": "ns/01",
                    }
                )
            ],
            ErrorCode.BAD_HEADER,
            "'keys'",
        ),
        (
            [
                msgpack.packb(
                    {
                        "v": PROTOCOL_VERSION,
                        "id": 1,
                        "op": "get",
                        "token": "tok-alice-0001",
                        "keys": ["ns/01"],
                    }
                ),
                b"extra",
            ],
            ErrorCode.BAD_FRAME,
            "no payload",
        ),
        (
            [
                msgpack.packb(
                    {
                        "v": PROTOCOL_VERSION,
                        "id": 1,
                        "op": "put",
                        "token": "tok-alice-0001",
                        "keys": ["ns/01"],
                        "sizes": [1],
                        "checksums": [0],
                    }
                ),
                b"a",
                b"b",
            ],
            ErrorCode.BAD_FRAME,
            "2 payload frames for 1 keys",
        ),
        (
            [msgpack.packb({"v": PROTOCOL_VERSION, "id": 1, "op": "get"})]
            + [b"x"] * zmq_max_frames(LIMITS),
            ErrorCode.BAD_FRAME,
            "too many",
        ),
        ([b""], ErrorCode.BAD_HEADER, "not msgpack"),
    ],
)
def test_malformed_frames_get_clear_errors(
    server: CacheServer, frames: list[bytes], code: ErrorCode, needle: str
) -> None:
    raw = Raw(server.bound_url)
    reply, payloads = raw.ask(frames)
    assert reply["code"] == code and needle in reply["error"] and payloads == []
    assert raw.op(op="lookup", keys=["ns/01"])["code"] == ErrorCode.OK  # still serving


def test_tokens_keys_and_limits(server: CacheServer) -> None:
    raw = Raw(server.bound_url)
    assert raw.op(op="lookup", keys=[], token="")["code"] == ErrorCode.UNAUTHORIZED
    assert raw.op(op="lookup", keys=[], token="tok-mallory-9")["error"] == "unknown token"
    missing = raw.ask([msgpack.packb({"v": PROTOCOL_VERSION, "id": 3, "op": "stats"})])[0]
    assert missing["code"] == ErrorCode.UNAUTHORIZED and missing["id"] == 3
    for bad in ("../etc/passwd", "nons", "a/b/c", "x" * 70 + "/01", "ns/\u00e9"):
        assert raw.op(op="get", keys=[bad])["code"] == ErrorCode.FORBIDDEN_KEY
    # carol may only use her namespaces' key prefixes.
    reply = raw.op(op="get", keys=["aaaa/01", "cccc/01"], token="tok-carol-0003")
    assert reply["code"] == ErrorCode.FORBIDDEN_KEY and "cccc/01" in reply["error"]
    assert raw.op(op="get", keys=["bbbb/01"], token="tok-carol-0003")["code"] == ErrorCode.OK
    assert raw.op(op="get", keys=[f"ns/{i}" for i in range(33)])["code"] == ErrorCode.TOO_MANY_KEYS
    big = b"z" * ((1 << 20) + 1)
    reply = _put(raw, "tok-alice-0001", ["ns/big"], [big])
    assert reply["code"] == ErrorCode.TOO_LARGE and "limit" in reply["error"]
    bad = raw.op([b"abc"], op="put", keys=["ns/cs"], sizes=[3], checksums=[checksum(b"abd")])
    assert bad["code"] == ErrorCode.CHECKSUM_MISMATCH
    assert raw.op(op="lookup", keys=["ns/cs", "ns/big"])["count"] == 0  # nothing stored


def test_put_of_anything_but_an_encoded_block_is_refused(server: CacheServer) -> None:
    raw = Raw(server.bound_url)
    reply = _put(raw, "tok-alice-0001", ["ns/j1"], [b"not a block at all, just bytes"])
    assert reply["code"] == ErrorCode.BAD_BLOCK and "bad_magic" in reply["error"]
    foreign = _block("other/j2", b"x" * 32)  # a well-formed block of another namespace
    reply = _put(raw, "tok-alice-0001", ["ns/ok", "ns/j2"], [_block("ns/ok", b"y"), foreign])
    assert reply["code"] == ErrorCode.BAD_BLOCK
    assert "payload 1" in reply["error"] and "namespace" in reply["error"]
    torn = bytearray(_block("ns/j3", b"z" * 64))
    torn[-10] ^= 1  # a flipped payload bit under a transport checksum that matches it
    reply = _put(raw, "tok-alice-0001", ["ns/j3"], [bytes(torn)])
    assert reply["code"] == ErrorCode.BAD_BLOCK and "checksum" in reply["error"]
    assert raw.op(op="lookup", keys=["ns/ok"])["count"] == 0  # nothing of a refused put stored
    assert raw.op(op="stats")["stats"] == {"namespace": "alice", "bytes": 0, "keys": 0}


def test_frame_over_zmq_limit_drops_peer_not_daemon(server: CacheServer) -> None:
    raw = Raw(server.bound_url)
    head = {
        "v": PROTOCOL_VERSION,
        "id": 1,
        "op": "put",
        "token": "tok-alice-0001",
        "keys": ["ns/x"],
        "sizes": [3 << 20],
        "checksums": [0],
    }
    raw.sock.send_multipart([msgpack.packb(head), b"\0" * (3 << 20)])
    assert not raw.sock.poll(500)  # disconnected by ZMQ's MAXMSGSIZE: no reply, no buffering
    assert Raw(server.bound_url).op(op="lookup", keys=["ns/x"])["count"] == 0


def test_no_cross_tenant_reads_and_quota(server: CacheServer) -> None:
    raw = Raw(server.bound_url)
    alice_block, bob_block = _block("ns/secret", b"alice-data"), _block("ns/secret", b"bob")
    assert _put(raw, "tok-alice-0001", ["ns/secret"], [alice_block])["code"] == 0
    assert raw.op(op="lookup", keys=["ns/secret"], token="tok-bob-000002")["count"] == 0
    bob_get = raw.op(op="get", keys=["ns/secret"], token="tok-bob-000002")
    assert bob_get["sizes"] == [-1]
    assert raw.op(op="delete", keys=["ns/secret"], token="tok-bob-000002")["deleted"] == 0
    assert raw.op(op="stats", token="tok-bob-000002")["stats"] == {
        "namespace": "bob",
        "bytes": 0,
        "keys": 0,
    }
    assert _put(raw, "tok-bob-000002", ["ns/secret"], [bob_block])["code"] == 0
    alice = raw.ask(
        [
            msgpack.packb(
                {
                    "v": PROTOCOL_VERSION,
                    "id": 9,
                    "op": "get",
                    "token": "tok-alice-0001",
                    "keys": ["ns/secret"],
                }
            )
        ]
    )
    assert alice[1] == [alice_block]
    # Quota: 4 MiB per namespace. Three 1 MiB blocks fit (plus a small one), a fifth does not.
    mib = _block("ns/q", b"q" * ((1 << 20) - 100))
    for i in range(3):
        assert _put(raw, "tok-alice-0001", [f"ns/q{i}"], [mib])["code"] == 0
    assert _put(raw, "tok-alice-0001", ["ns/q0"], [mib])["code"] == 0  # overwrite: no growth
    reply = _put(raw, "tok-alice-0001", ["ns/q3", "ns/q4"], [mib, mib])
    assert reply["code"] == ErrorCode.QUOTA_EXCEEDED and "alice" in reply["error"]
    assert _put(raw, "tok-bob-000002", ["ns/q3"], [mib])["code"] == 0  # bob has his own quota
    assert raw.op(op="delete", keys=["ns/q1"])["deleted"] == 1
    assert _put(raw, "tok-alice-0001", ["ns/q3"], [mib])["code"] == 0  # room again


def test_shm_segments_are_tenant_bound(server: CacheServer) -> None:
    if not shm.available():
        pytest.skip("no /dev/shm")
    raw = Raw(server.bound_url)
    seg = shm.ShmSegment.create(1 << 16)
    try:
        hello = raw.op(op="hello", host_id=shm.host_id(), shm=seg.name)
        assert hello["shm"] is True
        seg.buf[:5] = b"hello"
        reply = raw.op(
            op="put",
            token="tok-bob-000002",
            keys=["ns/s"],
            sizes=[5],
            checksums=[checksum(b"hello")],
            shm=seg.name,
            shm_offsets=[0],
        )
        assert reply["code"] == ErrorCode.SHM_UNAVAILABLE  # bob cannot use alice's segment
        reply = raw.op(
            op="put",
            keys=["ns/s"],
            sizes=[5],
            checksums=[checksum(b"hello")],
            shm=seg.name,
            shm_offsets=[(1 << 16) - 2],
        )
        assert reply["code"] == ErrorCode.BAD_HEADER  # offsets past the segment
        for name in ("../../etc/passwd", "kvtier-c-1-zz", "psm_1234"):
            assert raw.op(op="hello", host_id=shm.host_id(), shm=name)["shm"] is False
        assert raw.op(op="hello", host_id="elsewhere", shm=seg.name)["shm"] is False  # other host
    finally:
        seg.close()


def test_sixteen_clients_memory_bounded(tmp_path: Path, server_soak_s: float) -> None:
    seconds = server_soak_s
    port = free_port()
    (tmp_path / "tokens").write_text(TOKENS)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine.cli",
            "cache-server",
            "--port",
            str(port),
            "--admin-port",
            "-1",
            "--data-dir",
            str(tmp_path / "data"),
            "--lmdb-capacity",
            "48MiB",
            "--tokens",
            str(tmp_path / "tokens"),
            "--max-keys",
            "64",
            "--max-frame-bytes",
            "1MiB",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and "listening" in proc.stdout.readline()
        url = f"tcp://127.0.0.1:{port}"
        stop = threading.Event()
        errors: list[str] = []
        counts = [0] * 16

        def client(i: int) -> None:
            rng = random.Random(i)
            token = ["tok-alice-0001", "tok-bob-000002"][i % 2]
            tier = RemoteTier(url, token=token, timeout_s=10, use_shm=i % 4 == 0)
            raw = Raw(url)
            try:
                while not stop.is_set():
                    keys = [f"ns/{i:02x}{k:04x}" for k in rng.sample(range(400), 8)]
                    values = [_block(k, rng.randbytes(rng.choice((4096, 65536)))) for k in keys]
                    tier.put_many(list(zip(keys, values, strict=True)))
                    got = tier.get_many(keys)
                    # Each client owns its keys: a value is exactly what it put, or evicted.
                    for v, want in zip(got, values, strict=True):
                        if v is not None and bytes(v) != want:
                            errors.append(f"client {i}: wrong bytes")
                    if rng.random() < 0.2:  # hostile traffic mixed in
                        raw.ask([rng.randbytes(rng.randrange(1, 64))])
                    counts[i] += 1
            except (TierError, AssertionError) as exc:
                errors.append(f"client {i}: {exc}")
            finally:
                tier.close()
                raw.sock.close(0)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        time.sleep(min(2.0, seconds / 3))
        baseline = proc_status_kib(proc.pid, "RssAnon")
        peak = baseline
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.25)
            peak = max(peak, proc_status_kib(proc.pid, "RssAnon"))
        stop.set()
        for t in threads:
            t.join(30)
        assert errors == []
        assert all(c > 0 for c in counts), counts
        assert proc.poll() is None  # alive
        # Bounded: the working set is ~50 MB of LMDB (file-backed, not anonymous); anonymous
        # memory must not keep growing with traffic.
        assert peak - baseline < 96 * 1024, (baseline, peak)
        assert peak < 512 * 1024, peak
        print(f"soak {seconds}s: {sum(counts)} rounds, RssAnon {baseline} -> peak {peak} KiB")
    finally:
        proc.terminate()
        proc.wait(30)
