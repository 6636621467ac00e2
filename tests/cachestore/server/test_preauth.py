"""Issue 16 F2: a peer that never authenticates cannot make the daemon buffer its traffic.

The daemon runs as its own process (``kvtier cache-server``) and its VmRSS is sampled while
attackers push 3 GiB of declared-huge, unauthenticated traffic at each transport: on the TCP
stream, first messages declaring 64 MiB payloads and small non-attach headers followed by a
flood; on ZMQ, raw ZMTP peers with the NULL mechanism (no token) streaming 64 MiB frames,
and PLAIN peers with an unknown token whose handshake command is huge or whose frames follow
a refused handshake. The payload bytes come from one reused buffer (nothing stored client
side). Every attack connection is dropped early, and the RSS stays within 64 MiB.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from cachestore.server.daemon import CacheServer
from tests.cachestore.server.daemon_procs import rss_bytes, running_daemon, zmtp_greeting
from tests.cachestore.wire_helpers import RawFramed, served, tenant_daemon, zmq_ask
from tests.servers import free_port
from tiers.base import TierError
from tiers.remote.protocol import PROTOCOL_VERSION, ErrorCode, ServerLimits, pack
from tiers.remote.zap import PLAIN_USERNAME

TOKEN = "tok-alice-0001"
TOKENS = f"{TOKEN} alice\n"
TOTAL_BYTES = 3 << 30  # unauthenticated traffic per transport
MAX_GROWTH_BYTES = 64 << 20
CHUNK = memoryview(bytes(1 << 20))  # what every attacker sends, again and again
MIB64 = 64 << 20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int, int]]:
    """(pid, zmq port, stream port) of a real daemon process with one tenant."""
    tmp = tmp_path_factory.mktemp("preauth")
    (tmp / "tokens").write_text(TOKENS)
    port, stream_port = free_port(), free_port()
    with running_daemon(
        *("--port", str(port), "--admin-port", "-1", "--host-capacity", "64MiB"),
        *("--tokens", str(tmp / "tokens"), "--stream-port", str(stream_port)),
    ) as proc:
        yield proc.pid, port, stream_port


def _flood(sock: socket.socket, nbytes: int) -> int:
    """Send up to ``nbytes`` of zeros; the bytes sent before the peer dropped us."""
    sent = 0
    try:
        while sent < nbytes:
            sent += sock.send(CHUNK[: min(len(CHUNK), nbytes - sent)])
    except OSError:
        pass
    return sent


def _attack(pid: int, one: Callable[[], int], threads: int = 4) -> tuple[int, int, int]:
    """Run ``one`` (an attack connection; returns the bytes it got out) from ``threads``
    threads until TOTAL_BYTES went out, sampling the daemon's RSS. Returns (bytes sent,
    connections, RSS growth)."""
    baseline = rss_bytes(pid)
    peak = baseline
    lock = threading.Lock()
    totals = [0, 0]
    done = threading.Event()

    def worker() -> None:
        while not done.is_set():
            n = one()
            with lock:
                totals[0] += n
                totals[1] += 1
                if totals[0] >= TOTAL_BYTES:
                    done.set()

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 60
    while not done.wait(0.01) and time.monotonic() < deadline:
        peak = max(peak, rss_bytes(pid))
    done.set()
    for w in workers:
        w.join(30)
    peak = max(peak, rss_bytes(pid))
    return totals[0], totals[1], peak - baseline


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    return sock


def _stream_huge_first_message(port: int) -> int:
    """A first message declaring 4096 payloads of 64 MiB, then the payload bytes."""
    with _connect(port) as sock:
        header = pack({"v": PROTOCOL_VERSION, "id": 1, "op": "attach", "secret": "0" * 32})
        sock.sendall(
            struct.pack("<II", len(header), 4096) + struct.pack("<Q", MIB64) * 4096 + header
        )
        return _flood(sock, 1 << 30)


def _stream_refused_then_flood(port: int) -> int:
    """A small attach with a wrong secret, then 1 GiB anyway (as a next message's payload)."""
    with _connect(port) as sock:
        header = pack({"v": PROTOCOL_VERSION, "id": 1, "op": "attach", "secret": "0" * 32})
        sock.sendall(struct.pack("<II", len(header), 0) + header)
        nxt = pack({"v": PROTOCOL_VERSION, "id": 2, "op": "put", "token": TOKEN})
        sock.sendall(struct.pack("<II", len(nxt), 16) + struct.pack("<Q", MIB64) * 16 + nxt)
        return _flood(sock, 1 << 30)


def _flood_frames(sock: socket.socket, frames: int) -> int:
    """ZMTP long frames of 64 MiB (``frames`` of them declared), each streamed as it is
    read; returns the bytes the daemon took before it closed the connection."""
    sent = 0
    for _ in range(frames):
        try:
            sock.sendall(b"\x03" + struct.pack(">Q", MIB64))
        except OSError:
            break
        got = _flood(sock, MIB64)
        sent += got
        if got < MIB64:
            break
    return sent


def _zmq_null_multipart(port: int) -> int:
    """No token (ZMTP NULL mechanism), then a multipart message of 64 MiB frames."""
    with _connect(port) as sock:
        sock.sendall(zmtp_greeting(b"NULL"))
        ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        sock.sendall(bytes([0x04, len(ready)]) + ready)
        return _flood_frames(sock, 16)


def _zmq_plain_huge_hello(port: int) -> int:
    """A PLAIN handshake whose HELLO command declares 3 GiB (a command is buffered whole)."""
    with _connect(port) as sock:
        sock.sendall(zmtp_greeting(b"PLAIN"))
        sock.sendall(b"\x06" + struct.pack(">Q", 3 << 30) + b"\x05HELLO")
        return _flood(sock, 1 << 30)


def _zmq_plain_wrong_token(port: int) -> int:
    """A well-formed PLAIN handshake with an unknown token, then a 1 GiB multipart anyway."""
    with _connect(port) as sock:
        sock.sendall(zmtp_greeting(b"PLAIN"))
        password = b"tok-mallory-99"
        hello = (
            b"\x05HELLO"
            + bytes([len(PLAIN_USERNAME)])
            + PLAIN_USERNAME
            + bytes([len(password)])
            + password
        )
        sock.sendall(bytes([0x04, len(hello)]) + hello)
        return _flood_frames(sock, 16)


@pytest.mark.parametrize("attack", [_stream_huge_first_message, _stream_refused_then_flood])
def test_stream_buffers_nothing_before_attach(
    daemon: tuple[int, int, int], attack: Callable[[int], int]
) -> None:
    pid, _, stream_port = daemon
    sent, conns, growth = _attack(pid, lambda: attack(stream_port))
    print(f"{attack.__name__}: {sent >> 20} MiB over {conns} connections, RSS +{growth >> 20} MiB")
    assert sent >= TOTAL_BYTES and growth < MAX_GROWTH_BYTES, (sent, conns, growth)
    assert conns > 4 * (sent // (1 << 30))  # each connection was cut off, not served 1 GiB


@pytest.mark.parametrize(
    "attack", [_zmq_null_multipart, _zmq_plain_huge_hello, _zmq_plain_wrong_token]
)
def test_zmq_buffers_nothing_before_the_handshake(
    daemon: tuple[int, int, int], attack: Callable[[int], int]
) -> None:
    pid, port, _ = daemon
    sent, conns, growth = _attack(pid, lambda: attack(port))
    print(f"{attack.__name__}: {sent >> 20} MiB over {conns} connections, RSS +{growth >> 20} MiB")
    assert sent >= TOTAL_BYTES and growth < MAX_GROWTH_BYTES, (sent, conns, growth)
    assert conns > 4 * (sent // (1 << 30))
    # The daemon still serves a client with the token.
    assert zmq_ask(f"tcp://127.0.0.1:{port}", TOKEN, op="stats")["code"] == ErrorCode.OK


@pytest.fixture
def quick_daemon() -> Iterator[CacheServer]:
    """In-process daemon with a short attach deadline and a 64 MiB request cap."""
    yield from served(
        tenant_daemon(
            TOKENS,
            8 << 20,
            1 << 20,
            attach_timeout_s=0.3,
            limits=ServerLimits(max_request_bytes=64 << 20),
        )
    )


def test_stream_deadline_and_request_cap(quick_daemon: CacheServer) -> None:
    stream = quick_daemon.stream
    assert stream is not None and stream.port is not None
    address = ("127.0.0.1", stream.port)
    silent = RawFramed(address)  # says nothing: dropped at the deadline
    t0 = time.monotonic()
    assert silent.closed_by_peer() and time.monotonic() - t0 < 2
    slow = RawFramed(address)  # half a prefix, then nothing: the deadline is for the whole
    slow.sock.sendall(b"\x10\0\0")
    t0 = time.monotonic()
    assert slow.closed_by_peer() and time.monotonic() - t0 < 2
    # Attached, a message whose declared payloads add up past max_request_bytes (each one
    # within max_frame_bytes) closes the connection before a payload byte is read.
    hello = zmq_ask(quick_daemon.bound_url, TOKEN, op="hello", host_id="elsewhere", stream=True)
    raw = RawFramed(address)
    assert raw.ask(op="attach", secret=hello["stream_secret"])["code"] == ErrorCode.OK
    assert raw.ask(op="stats", token=TOKEN)["code"] == ErrorCode.OK
    header = pack({"v": PROTOCOL_VERSION, "id": 4, "op": "put", "token": TOKEN})
    raw.sock.sendall(
        struct.pack("<II", len(header), 2) + struct.pack("<QQ", 40 << 20, 40 << 20) + header
    )
    assert raw.closed_by_peer()


def test_zmq_handshake_deadline(quick_daemon: CacheServer) -> None:
    """A ZMQ peer that starts the handshake and stalls is dropped at the deadline."""
    port = int(str(quick_daemon.bound_url).rsplit(":", 1)[1])
    with _connect(port) as sock:
        sock.sendall(zmtp_greeting(b"PLAIN"))
        t0 = time.monotonic()
        got = b""
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                break
            got += chunk
        assert len(got) == 64 and time.monotonic() - t0 < 2.5  # its greeting, then closed


@pytest.fixture
def big_slot_daemon() -> Iterator[CacheServer]:
    yield from served(tenant_daemon(TOKENS, 64 << 20, 16 << 20))


def test_large_blocks_cross_zmq_in_small_frames(big_slot_daemon: CacheServer) -> None:
    """A block over ZMQ_FRAME_BYTES goes as several frames and comes back whole; a client with
    an unknown token is refused in the handshake (counted), with nothing stored."""
    from tests.cachestore.store_helpers import sized_block
    from tiers.remote.tier import RemoteTier

    quick_daemon = big_slot_daemon
    tier = RemoteTier(quick_daemon.bound_url, token=TOKEN, use_shm=False, use_stream=False)
    bad = RemoteTier(
        quick_daemon.bound_url,
        token="tok-mallory-99",
        use_shm=False,
        use_stream=False,
        timeout_s=0.5,
    )
    try:
        blocks = {
            f"ns/{i:02x}": sized_block(f"ns/{i:02x}", n)
            for i, n in enumerate((9 << 20, (4 << 20) + 1, 4 << 20, 100))
        }
        tier.put_many(list(blocks.items()))
        assert tier.transport() == "zmq"
        got = tier.get_many(list(blocks))
        assert [bytes(v) if v is not None else None for v in got] == list(blocks.values())
        zap = quick_daemon.zap
        assert zap is not None and zap.num_denied == 0
        with pytest.raises(TierError):
            bad.put_many([("ns/zz", sized_block("ns/zz", 100))])
        assert zap.num_denied >= 1 and tier.lookup(["ns/zz"]) == 0
    finally:
        tier.close()
        bad.close()


def test_stream_request_arenas_are_bounded(quick_daemon: CacheServer) -> None:
    """Issue 16 F7: attached connections share MAX_ARENA_BYTES of reused request buffers;
    past it a connection still works (buffers freed after each request), and a closed
    connection gives its arena back."""
    from cachestore.server.doorbell import MAX_ARENA_BYTES, REQUEST_ARENA_BYTES

    stream = quick_daemon.stream
    assert stream is not None and stream.port is not None
    conns = []
    for _ in range(MAX_ARENA_BYTES // REQUEST_ARENA_BYTES + 2):
        hello = zmq_ask(quick_daemon.bound_url, TOKEN, op="hello", host_id="elsewhere", stream=True)
        raw = RawFramed(("127.0.0.1", stream.port))
        assert raw.ask(op="attach", secret=hello["stream_secret"])["code"] == ErrorCode.OK
        assert raw.ask(op="stats", token=TOKEN)["code"] == ErrorCode.OK
        conns.append(raw)
    assert stream.arena_bytes == MAX_ARENA_BYTES
    for raw in conns:
        raw.sock.close()
    deadline = time.monotonic() + 5
    while stream.arena_bytes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stream.arena_bytes == 0
