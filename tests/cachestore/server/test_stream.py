"""The TCP stream (cachestore.server.doorbell with ``tcp``): clients without a shared segment send
requests and payload frames over a plain TCP connection bound to the tenant whose hello issued
the one-time secret; ZMQ whenever the stream is off, refused or broken; a daemon restart is
misses, then hits, never an error."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cachestore.server.daemon import CacheServer
from cachestore.store.hierarchical import HierarchicalStore
from tests.cachestore.store_helpers import sized_block
from tests.cachestore.wire_helpers import (
    RawFramed,
    attach_checked,
    check_restart,
    served,
    tenant_daemon,
    zmq_ask,
)
from tests.servers import free_port
from tiers.remote.bell_framing import MessageReader, send_message
from tiers.remote.protocol import ErrorCode, ServerLimits, checksum
from tiers.remote.tier import RemoteTier

TOKENS = "tok-alice-0001 alice\ntok-bob-000002 bob\n"
ALICE, BOB = "tok-alice-0001", "tok-bob-000002"
KEYS = [f"aaaa/{i:032x}" for i in range(6)]
# Larger than a loopback socket buffer takes in one sendmsg: the rest goes part by part.
BLOCKS = [sized_block(k, (3 << 20) + 4099 * i) for i, k in enumerate(KEYS)]


def _daemon(url: str = "tcp://127.0.0.1:0", **config: Any) -> tuple[CacheServer, HierarchicalStore]:
    return tenant_daemon(
        TOKENS, 64 << 20, 4 << 20, url, limits=ServerLimits(max_frame_bytes=8 << 20), **config
    )


@pytest.fixture
def daemon() -> Iterator[CacheServer]:
    yield from served(_daemon())


def _hello(url: str, token: str, **extra: Any) -> dict[str, Any]:
    """A raw ZMQ hello without a segment, asking for the stream."""
    return zmq_ask(url, token, op="hello", host_id="elsewhere", **{"stream": True, **extra})


def RawStream(port: int) -> RawFramed:  # noqa: N802 (reads as the class it returns)
    return RawFramed(("127.0.0.1", port))


def test_round_trip_goes_through_the_stream(
    daemon: CacheServer, remote: Callable[..., RemoteTier]
) -> None:
    stream = daemon.stream
    assert stream is not None and stream.port is not None
    tier = remote(daemon.bound_url, token=ALICE, use_shm=False, batch_keys=4)
    tier.put_many(list(zip(KEYS, BLOCKS, strict=True)))  # hello over ZMQ, then 2 puts
    assert tier.transport() == "stream"
    before = stream.num_requests
    got = tier.get_many(list(reversed(KEYS)))  # 2 requests, 18 MiB of replies
    assert [bytes(v) for v in got] == list(reversed(BLOCKS))
    again = tier.get_many(KEYS[:2])  # the reply buffer is reused: still exact bytes
    assert [bytes(v) for v in again] == BLOCKS[:2]
    assert tier.get_many(["aaaa/" + "f" * 32]) == [None]
    assert tier.lookup(KEYS) == 6 and tier.delete_many(KEYS[:1]) == 1
    assert tier.lookup(KEYS) == 0 and tier.lookup(KEYS[1:]) == 5
    # get 2, get 1, get 1, lookup 2, delete 1, lookup 2 + 2
    assert stream.num_requests - before == 11


def test_stream_binds_the_daemons_host_and_the_given_port() -> None:
    port = free_port()
    srv, store = _daemon(stream_port=port)
    try:
        assert srv.stream is not None and srv.stream.port == port
        probe = socket.create_connection(("127.0.0.1", port), timeout=5)
        probe.close()
        assert srv.stream._listener is not None  # white-box: the listener's address
        assert srv.stream._listener.getsockname()[0] == "127.0.0.1"
    finally:
        srv.stop()
        store.close()
    assert srv.stream.port is None
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)


def test_stream_secrets_bind_a_connection_to_one_tenant(
    daemon: CacheServer, remote: Callable[..., RemoteTier]
) -> None:
    alice = remote(daemon.bound_url, token=ALICE, use_shm=False)
    alice.put_many([(KEYS[0], BLOCKS[0])])
    bob = remote(daemon.bound_url, token=BOB, use_shm=False)
    assert bob.get_many([KEYS[0]]) == [None] and bob.lookup(KEYS[:1]) == 0
    assert alice.transport() == bob.transport() == "stream"
    offer = _hello(daemon.bound_url, ALICE)
    port, secret = offer["stream_port"], offer["stream_secret"]
    assert offer["shm"] is False and len(secret) == 32 and "doorbell" not in offer
    raw = attach_checked(("127.0.0.1", port), secret, ALICE, KEYS[:1])
    assert raw.ask(op="lookup", token=ALICE, keys=KEYS[:1])["count"] == 1
    for token in (BOB, ""):  # Bob's token on Alice's connection, or none: refused
        assert raw.ask(op="get", token=token, keys=KEYS[:1])["code"] == ErrorCode.UNAUTHORIZED
    # A put with a torn payload (wrong checksum) is refused and stores nothing.
    key = KEYS[1]
    reply = raw.ask(
        (BLOCKS[1],),
        op="put",
        token=ALICE,
        keys=[key],
        sizes=[len(BLOCKS[1])],
        checksums=[checksum(BLOCKS[1]) ^ 1],
    )
    assert reply["code"] != ErrorCode.OK and alice.lookup([key]) == 0
    assert RawStream(port).ask(op="attach", secret=secret)["code"] == ErrorCode.UNAUTHORIZED
    # No stream for a client that does not ask for one, nor with a bad token.
    assert "stream_port" not in _hello(daemon.bound_url, ALICE, stream=False)
    assert (
        zmq_ask(
            daemon.bound_url,
            "nope",
            handshake_token=ALICE,
            op="hello",
            host_id="elsewhere",
            stream=True,
        )["code"]
        == ErrorCode.UNAUTHORIZED
    )
    with pytest.raises(AssertionError, match="no reply"):  # refused in the ZMTP handshake
        zmq_ask(daemon.bound_url, "nope", timeout_ms=500, op="hello")


def test_oversize_and_garbage_drop_the_connection_only(
    daemon: CacheServer, remote: Callable[..., RemoteTier]
) -> None:
    stream = daemon.stream
    assert stream is not None and stream.port is not None
    for garbage in (
        b"\xff\xff\xff\x7f\x00\x00\x00\x00",  # a header length over the limit
        b"\x03\x00\x00\x00\x00\x00\x00\x00\xc1\xc1\xc1",
    ):  # not msgpack
        raw = RawStream(stream.port)
        raw.sock.sendall(garbage)
        assert raw.closed_by_peer()
    raw = RawStream(stream.port)
    raw.ask(op="attach", secret=_hello(daemon.bound_url, ALICE)["stream_secret"])
    # A payload frame declared over max_frame_bytes (8 MiB): dropped before it is read.
    raw.sock.sendall(
        b"\x10\x00\x00\x00\x01\x00\x00\x00" + (9 << 20).to_bytes(8, "little") + b"\x80" * 16
    )  # the 16 header bytes announced; no payload follows
    assert raw.closed_by_peer()
    tier = remote(daemon.bound_url, token=ALICE, use_shm=False)
    tier.put_many([(KEYS[3], BLOCKS[3])])
    assert bytes(tier.get_many(KEYS[3:4])[0]) == BLOCKS[3] and tier.transport() == "stream"


def test_zmq_without_a_stream_and_after_it_breaks(
    daemon: CacheServer, remote: Callable[..., RemoteTier]
) -> None:
    off = remote(daemon.bound_url, token=ALICE, use_shm=False, use_stream=False)
    off.put_many([(KEYS[1], BLOCKS[1])])
    assert off.transport() == "zmq"
    tier = remote(daemon.bound_url, token=ALICE, use_shm=False)
    assert bytes(tier.get_many(KEYS[1:2])[0]) == BLOCKS[1] and tier.transport() == "stream"
    stream = daemon.stream
    assert stream is not None
    stream.stop()  # the listener and its connections go away; the ZMQ side keeps serving
    assert bytes(tier.get_many(KEYS[1:2])[0]) == BLOCKS[1]  # no error, same answer
    assert tier.lookup(KEYS[1:2]) == 1 and tier.transport() == "zmq"
    srv, store = _daemon(stream=False)
    try:
        assert srv.stream is None
        plain = remote(srv.bound_url, token=ALICE, use_shm=False)
        plain.put_many([(KEYS[0], BLOCKS[0])])
        assert bytes(plain.get_many(KEYS[:1])[0]) == BLOCKS[0] and plain.transport() == "zmq"
    finally:
        srv.stop()
        store.close()


def test_daemon_restart_is_misses_then_hits_on_a_new_stream(
    remote: Callable[..., RemoteTier],
) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    tier = remote(url, token=ALICE, use_shm=False, timeout_s=5)
    stream = check_restart(url, _daemon, tier, KEYS[2], BLOCKS[2], "stream")
    assert stream is not None and stream.num_requests >= 2


def test_cli_stream_flags(tmp_path: Any) -> None:
    import subprocess
    import sys

    root = os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    )
    port, stream_port = free_port(), free_port()
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
            "--host-capacity",
            "8MiB",
            "--host-slot-bytes",
            "4MiB",
            "--stream-port",
            str(stream_port),
            "--data-dir",
            str(tmp_path),
        ],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and "listening" in proc.stdout.readline()
        offer = _hello(f"tcp://127.0.0.1:{port}", "")
        assert offer["code"] == ErrorCode.OK and offer["stream_port"] == stream_port
    finally:
        proc.terminate()
        proc.wait(10)


def test_reader_arena_reuses_its_buffer_and_caps_it() -> None:
    """Payloads up to the arena size land in one reused buffer (overwritten after ``rewind``);
    a payload past the cap gets a buffer of its own; growing keeps earlier views intact."""
    import threading

    a, b = socket.socketpair()
    one, two, big, w = (b"x" * (1 << 20), b"y" * (1 << 20), b"z" * (4 << 20), b"w" * (2 << 20))
    messages = [(b"h1", [one, two]), (b"h2", [w]), (b"h3", [two]), (b"h4", [big])]
    sender = threading.Thread(target=lambda: [send_message(a, h, p) for h, p in messages])
    sender.start()
    try:
        reader = MessageReader(b, arena=3 << 20)
        _, p1, p2 = reader.read()
        assert bytes(p1) == one and bytes(p2) == two and isinstance(p1, memoryview)
        (_, p3) = reader.read()  # grows the arena: p1 and p2 stay as they were
        assert bytes(p1) == one and bytes(p2) == two and bytes(p3) == w
        reader.rewind()
        (_, p4) = reader.read()  # reuses the arena from its start: p3 is overwritten
        assert bytes(p4) == two and bytes(p3[: 1 << 20]) == two
        reader.rewind()
        (_, p5) = reader.read()  # over the cap: a buffer of its own
        assert isinstance(p5, bytearray) and bytes(p5) == big and bytes(p4) == two
    finally:
        sender.join(10)
        a.close()
        b.close()
