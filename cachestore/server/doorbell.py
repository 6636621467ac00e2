"""Doorbell: the cache daemon's requests and replies over a plain stream socket, not ZMQ.

Two kinds, one class: the same-host doorbell (a Unix socket; payloads in the client's
shared-memory segment) and the TCP stream (``tcp=(host, port)``: a TCP listener on the
daemon's own address, payload frames on the socket, for clients on another host or without
shared memory). The stream exists for the same reason as the doorbell: ZMQ's I/O threads
add a hand-off per side and message, which on a 2-core VM cost 2 MiB single gets/puts 12-17%
against redis-server (docs/cache_server.md, "TCP stream"); a blocking socket served by one
thread per connection is one ``sendmsg`` and ``recv_into`` calls per side. A stream is
offered in the hello reply (``stream_port``, ``stream_secret``) to a client that asks for it
(``stream: true``) and attached no segment; the attach, token and namespace checks are the
doorbell's (below), leases never (no shared slab across hosts). It binds the ZMQ url's host,
so an open daemon's stream is loopback-only like its ZMQ socket.

Why: on one host the payloads already move through the client's shared-memory segment
(``tiers.remote.shm``); what is left of a single-key request is the transport, and ZMQ adds two
I/O-thread hops per side (~90 us a round trip on 2 cores). A blocking Unix socket served by
one daemon thread per connection is one ``sendmsg`` and one ``recv_into`` per side.

Handshake and binding (the security model of the doorbell):
- A client whose ``hello`` (over ZMQ, authenticated by its token) attached a segment, and that
  asked for it (``doorbell: true``), gets ``doorbell`` (the socket path) and
  ``doorbell_secret`` (128 random bits, hex) in the hello reply. ``Doorbell.offer`` records the
  secret with the tenant it was issued to; it expires after ``SECRET_TTL_S`` and works once.
- The socket is a file of mode 0600 in a fresh 0700 directory the daemon made (only its user
  can connect; the client's segment needs the same user anyway). The first message on a
  connection must be ``{"op": "attach", "secret": ...}``, small and without payloads, within
  ``attach_timeout_s`` (``bell_framing.read_attach``: nothing else is read before it is
  checked): the connection is then bound to that tenant, or refused and closed. Every later request is parsed and authenticated exactly as on
  ZMQ (``OpHandler.parse``: token, key prefixes, limits) and must also name the bound tenant's
  token: a second tenant cannot ride on a connection it did not attach.
- Payloads still travel through the segment; frames over the socket are allowed (a batch
  larger than the segment), bounded by the daemon's limits.
- In-place reads (``cachestore.server.leases``): an attach that asks for them (``lease: true``) when
  the daemon offers them (one namespace in its slab) is answered with ``slab: true`` and the
  host slab's sealed memfd attached (SCM_RIGHTS); host-hit gets on that connection that ask
  (``lease: true``) then answer slab offsets under leases, released on ``release: true`` and
  when the connection closes.

Waiting: a reader polls its socket for up to ``spin_s`` (yielding the CPU between polls)
before it blocks. On this 2-core VM a blocked reader's wake-up is most of a small round trip
(a Unix-socket ping-pong between two processes: 46 us p50 blocking, 5-11 us with a 20-200 us
spin); the spin is bounded, so an idle connection costs nothing after it.

Framing: ``tiers.remote.bell_framing``. Requests on a connection are served in order.
Thread-safe: ``offer`` from any thread; ``start``/``stop`` once each, from the daemon's thread.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import msgpack

from cachestore.server.leases import ConnLeases, LeaseOffer
from tiers.remote.bell_framing import BellClosed, MessageReader, read_attach, send_message
from tiers.remote.protocol import ErrorCode, Reply, ServerLimits, error_header, pack

if TYPE_CHECKING:
    from cachestore.server.ops import OpHandler

__all__ = ["BellClosed", "Doorbell", "MessageReader", "send_message"]
SECRET_TTL_S = 30.0
# A connection's request payloads up to this much land in a buffer reused from request to
# request (the store copies a put's payloads before the reply, as for the client's segment);
# bigger requests get buffers of their own. Bounds a connection's idle memory.
REQUEST_ARENA_BYTES = 8 << 20
# Arenas of all of a listener's connections together (16 connections' worth): past it, a
# new connection reads its payloads into buffers freed after each request, so 256 idle
# connections cannot hold 2 GiB between them.
MAX_ARENA_BYTES = 128 << 20
MAX_PENDING_SECRETS = 1024


class Doorbell:
    """The daemon side: a Unix socket (or, with ``tcp``, a TCP listener), one thread per
    connection, requests run in that thread (``OpHandler.parse``, then ``serve_inline`` or
    ``run``). ``max_conns`` bounds the threads: a connection past it is closed at once (the
    client stays on ZMQ)."""

    def __init__(
        self,
        limits: ServerLimits,
        max_conns: int = 256,
        directory: str | None = None,
        inline_reads: bool = True,
        spin_s: float = 100e-6,
        leases: LeaseOffer | None = None,
        tcp: tuple[str, int] | None = None,
        attach_timeout_s: float = 3.0,
    ) -> None:
        """``leases``: offer in-place reads to connections that ask (None: never; never over
        TCP). ``tcp``: listen on this (host, port) instead (port 0: any free port).
        ``attach_timeout_s``: a connection that has not attached by then is closed."""
        self._limits = limits
        self._attach_timeout_s = attach_timeout_s
        self._tcp = tcp
        self._leases = leases if tcp is None else None
        self._spin_s = spin_s
        self._max_conns = max_conns
        self._directory = directory
        self._inline = inline_reads
        self._lock = threading.Lock()
        self._pending: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self.arena_bytes = 0  # reserved by attached connections (under _lock)
        self._listener: socket.socket | None = None
        self._dir: str | None = None
        self._handler: OpHandler | None = None
        self.path: str | None = None  # the Unix socket's path while it runs
        self.port: int | None = None  # the TCP stream's port while it runs
        # Requests served through the doorbell (tests, diagnostics; unlocked: may undercount
        # under concurrent connections).
        self.num_requests = 0

    def start(self, handler: OpHandler) -> str:
        """Bind the socket (mode 0600 in a fresh 0700 directory; or the TCP address) and
        accept on a thread. Returns the path (``host:port`` for TCP). Raises OSError."""
        self._handler = handler
        if self._tcp is not None:
            host, port = self._tcp
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            listener = socket.create_server((host, port), family=family, backlog=64)
            self._listener, self.port = listener, listener.getsockname()[1]
            threading.Thread(target=self._accept, name="kvtier-stream-accept", daemon=True).start()
            return f"{host}:{self.port}"
        self._dir = tempfile.mkdtemp(prefix="kvtier-bell-", dir=self._directory)
        path = os.path.join(self._dir, "bell.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            listener.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        listener.listen(64)
        self._listener, self.path = listener, path
        threading.Thread(target=self._accept, name="kvtier-bell-accept", daemon=True).start()
        return path

    def offer(self, tenant: str) -> dict[str, Any]:
        """Hello-reply fields that let ``tenant`` attach one connection: path (or TCP port) and
        a one-time secret. Empty when the doorbell is not running."""
        if self.path is None and self.port is None:
            return {}
        secret = secrets.token_bytes(16)
        now = time.monotonic()
        with self._lock:
            while self._pending and (
                len(self._pending) >= MAX_PENDING_SECRETS
                or next(iter(self._pending.values()))[1] < now
            ):
                self._pending.popitem(last=False)
            self._pending[_digest(secret)] = (tenant, now + SECRET_TTL_S)
        if self.port is not None:
            return {"stream_port": self.port, "stream_secret": secret.hex()}
        return {"doorbell": self.path, "doorbell_secret": secret.hex()}

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, let each connection finish the request it is serving, close all.
        Idempotent."""
        listener, self._listener = self._listener, None
        if listener is not None:
            try:  # wakes the accept thread (Linux): a bare close leaves the port listening
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        with self._lock:
            conns = list(self._conns.items())
        for sock, _ in conns:
            try:
                sock.shutdown(socket.SHUT_RD)  # wakes a blocked recv with EOF
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for _, thread in conns:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self.path = self.port = None

    def _accept(self) -> None:
        while True:
            listener = self._listener
            if listener is None:
                return
            try:
                sock, _ = listener.accept()
            except OSError:
                return  # closed by stop
            if self._tcp is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if len(self._conns) >= self._max_conns or self._listener is None:
                    sock.close()
                    continue
                thread = threading.Thread(
                    target=self._serve, args=(sock,), daemon=True, name="kvtier-bell"
                )
                self._conns[sock] = thread
            thread.start()

    def _claim(self, secret: object) -> str | None:
        if not isinstance(secret, str) or len(secret) != 32:
            return None
        try:
            raw = bytes.fromhex(secret)
        except ValueError:
            return None
        with self._lock:
            held = self._pending.pop(_digest(raw), None)
        if held is None or held[1] < time.monotonic():
            return None
        return held[0]

    def _serve(self, sock: socket.socket) -> None:
        handler = self._handler
        assert handler is not None
        leases: ConnLeases | None = None
        arena = 0
        try:
            first = _unpack(read_attach(sock, self._attach_timeout_s))
            tenant = self._claim(first.get("secret")) if first.get("op") == "attach" else None
            code = ErrorCode.OK if tenant is not None else ErrorCode.UNAUTHORIZED
            reply = error_header(first.get("id", 0), code, "" if tenant else "bad or used secret")
            fds: list[int] = []
            if tenant is not None and first.get("lease") is True and self._leases is not None:
                leases = self._leases.open()
                reply["slab"] = True
                fds.append(self._leases.fd)
            send_message(sock, pack(reply), fds=fds)
            if tenant is not None:  # a buffer only for an attached connection
                with self._lock:
                    if self.arena_bytes + REQUEST_ARENA_BYTES <= MAX_ARENA_BYTES:
                        arena = REQUEST_ARENA_BYTES
                        self.arena_bytes += arena
                reader = MessageReader(sock, self._limits, self._spin_s, arena)
            while tenant is not None:
                reader.rewind()  # the previous request is answered: its payloads are stored
                self._serve_one(sock, handler, tenant, reader.read(), leases)
        except Exception:  # a peer that vanished or sent garbage is dropped, never a traceback
            pass  # (BellClosed is an OSError; msgpack raises a zoo of types)
        finally:
            if leases is not None:  # closed, crashed or killed: its pins go back now
                leases.release()
            with self._lock:
                self._conns.pop(sock, None)
                self.arena_bytes -= arena
            sock.close()

    def _serve_one(
        self,
        sock: socket.socket,
        handler: OpHandler,
        tenant: str,
        frames: list[Any],
        leases: ConnLeases | None,
    ) -> None:
        self.num_requests += 1

        def send(reply: Reply) -> None:
            send_message(sock, pack(reply.header), reply.payloads)

        parsed = handler.parse(frames)
        if isinstance(parsed, Reply):
            send(parsed)
            return
        if parsed.tenant != tenant:
            send(
                handler.refuse(
                    parsed, ErrorCode.UNAUTHORIZED, "this connection is bound to another namespace"
                )
            )
            return
        if leases is not None:
            if parsed.header.get("release") is True:  # the client's previous call is over
                leases.release()
            if parsed.header.get("lease") is True and handler.serve_leased(parsed, send, leases):
                return
        if not (self._inline and handler.serve_inline(parsed, send)):
            send(handler.run(parsed))


def _unpack(raw: bytes) -> dict[str, Any]:
    header = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=0)
    if not isinstance(header, dict):
        raise ValueError("attach header must be a map")
    return header


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()
