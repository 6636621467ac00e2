"""Raw wire clients for the cache daemon's tests: one ZMQ request, and a bare framed connection
(doorbell or TCP stream) that sends whatever a test wants."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import zmq

from cachestore.server.daemon import CacheServer, ServerConfig
from cachestore.server.doorbell import Doorbell
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from tiers.host import HostTier
from tiers.remote.bell_framing import MessageReader, send_message
from tiers.remote.protocol import PROTOCOL_VERSION, ErrorCode, TokenTable, pack
from tiers.remote.zap import secure_client


def zmq_ask(
    url: str, token: str, handshake_token: str | None = None, timeout_ms: int = 5000, **header: Any
) -> dict[str, Any]:
    """One request over a fresh DEALER socket (its ZMTP handshake with ``handshake_token``,
    default ``token``); the reply's header."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client(sock, token if handshake_token is None else handshake_token)
    sock.connect(url)
    try:
        # A handshake refused before the send leaves the DEALER without a peer: a blocking
        # send would wait forever, so wait for room as long as for the reply.
        assert sock.poll(timeout_ms, zmq.POLLOUT), "no reply"
        sock.send(pack({"v": PROTOCOL_VERSION, "id": 1, "token": token, **header}), zmq.NOBLOCK)
        assert sock.poll(timeout_ms), "no reply"
        return msgpack.unpackb(sock.recv_multipart()[0])
    finally:
        sock.close()


class RawFramed:
    """A bare framed connection: ``address`` a Unix socket path or a (host, port) pair."""

    def __init__(self, address: str | tuple[str, int]) -> None:
        if isinstance(address, str):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(5)
            self.sock.connect(address)
        else:
            self.sock = socket.create_connection(address, timeout=5)
        self.reader = MessageReader(self.sock)

    def ask(self, payloads: tuple[bytes, ...] = (), **header: Any) -> dict[str, Any]:
        send_message(self.sock, pack({"v": PROTOCOL_VERSION, "id": 3, **header}), payloads)
        return msgpack.unpackb(self.reader.read()[0])

    def closed_by_peer(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True


def tenant_daemon(
    tokens: str, capacity: int, slot_bytes: int, url: str = "tcp://127.0.0.1:0", **config: Any
) -> tuple[CacheServer, HierarchicalStore]:
    """A started daemon over one host tier, serving the tenants of ``tokens``; ``config`` goes
    to ``ServerConfig``. The caller stops it and closes the store."""
    store = HierarchicalStore([HostTier(capacity, slot_bytes, pin_memory=False)], StoreConfig())
    srv = CacheServer(ServerConfig(url=url, **config), store, TokenTable.parse(tokens)).start()
    return srv, store


def attach_checked(
    address: str | tuple[str, int], secret: str, token: str, keys: list[str]
) -> RawFramed:
    """The attach rules of a doorbell or stream listener, asserted: a first message that is not
    an attach, or an attach with a wrong secret, is refused and the connection closed; the
    issued secret attaches. Returns that attached connection."""
    raw = RawFramed(address)
    assert raw.ask(op="get", token=token, keys=keys)["code"] == ErrorCode.UNAUTHORIZED
    assert raw.closed_by_peer()
    raw = RawFramed(address)
    assert raw.ask(op="attach", secret="0" * 32)["code"] == ErrorCode.UNAUTHORIZED
    assert raw.closed_by_peer()
    raw = RawFramed(address)
    assert raw.ask(op="attach", secret=secret)["code"] == ErrorCode.OK
    return raw


def served(daemon: tuple[CacheServer, HierarchicalStore]) -> Iterator[CacheServer]:
    """Fixture body: yield the daemon, then stop it and close its store."""
    srv, store = daemon
    try:
        yield srv
    finally:  # also when the test's body raised: a failed test leaves no daemon running
        srv.stop()
        store.close()


def check_restart(
    url: str,
    make: Callable[[str], tuple[CacheServer, HierarchicalStore]],
    tier: Any,
    key: str,
    block: bytes,
    transport: str,
) -> Doorbell | None:
    """``tier`` stores ``block`` on the daemon ``make(url)`` over ``transport``; the daemon is
    stopped and made again (memory only): the next get is a miss within 4 s, not an error, and
    after a put it hits over ``transport`` again. Returns the new daemon's listener of that
    transport (as it was before the new daemon stopped)."""
    srv, store = make(url)
    tier.put_many([(key, block)])
    assert bytes(tier.get_many([key])[0]) == block and tier.transport() == transport
    srv.stop()
    store.close()
    srv, store = make(url)  # memory only: the block is gone
    try:
        t0 = time.monotonic()
        assert tier.get_many([key]) == [None]  # a miss, not an error
        assert time.monotonic() - t0 < 4
        tier.put_many([(key, block)])
        assert bytes(tier.get_many([key])[0]) == block and tier.transport() == transport
        return srv.stream if transport == "stream" else srv.doorbell
    finally:
        srv.stop()
        store.close()
