"""A cap on the daemon's ZMQ connections that have not finished their handshake.

Why: libzmq bounds what one unauthenticated peer can make the daemon hold (one handshake
command, at most ``MAXMSGSIZE``, for at most ``HANDSHAKE_IVL``) but not how many such peers
there are: 1,024 parallel peers held 2.2 GB. libzmq has no option for it, so this thread
watches the ROUTER's connections and cuts the excess.

How: a ZMQ socket monitor reports each accepted connection's file descriptor (and its end).
A connection is *pending* while the daemon has sent it nothing but its 64-byte ZMTP
greeting: the PLAIN server's next bytes (WELCOME, or ERROR) come only after the ZAP
handler has judged the peer's HELLO. ``TCP_INFO`` gives, per descriptor, the bytes the
daemon sent (``tcpi_bytes_acked``) and received (``tcpi_bytes_received``, what a pending
peer can have made libzmq buffer). When more than ``max_pending`` connections are pending,
the ones that sent the most are shut down (``shutdown(SHUT_RDWR)``: libzmq sees the end of
the stream and closes its own descriptor; this thread never closes one). A descriptor is
judged only if it is still a TCP socket on the daemon's own address (a closed and reused
number is harmless: judged by what it is now). A connection stops being watched once it
sent more than the greeting, or after the handshake interval and a grace period (libzmq
has dropped it by then).

The total pre-authentication memory is then at most about ``max_pending`` x
(``MAXMSGSIZE`` + libzmq's per-connection buffers), plus what arrives within one sweep
interval (``SWEEP_S``). TCP only: an ipc:// daemon is reached through the file system.
Start after bind, ``stop`` before the context terminates.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time

import zmq

log = logging.getLogger(__name__)

GREETING_BYTES = 64  # ZMTP 3.x: what the server sends before the mechanism's reply
SWEEP_S = 0.01  # how often pending connections are checked while there are some
_IDLE_POLL_MS = 200
_TCP_INFO_LEN = 256
_BYTES_ACKED_OFF = 120  # struct tcp_info (Linux >= 4.2): u64 tcpi_bytes_acked
_BYTES_RECEIVED_OFF = 128  # u64 tcpi_bytes_received


def tcp_bytes(sock: socket.socket) -> tuple[int, int] | None:
    """(bytes sent and acknowledged, bytes received) of a TCP socket; None when the kernel
    does not report them."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except OSError:
        return None
    if len(info) < _BYTES_RECEIVED_OFF + 8:
        return None
    return (
        struct.unpack_from("<Q", info, _BYTES_ACKED_OFF)[0],
        struct.unpack_from("<Q", info, _BYTES_RECEIVED_OFF)[0],
    )


class HandshakeGuard:
    """Caps the ROUTER's pending (unauthenticated) connections at ``max_pending``.
    ``num_cut`` counts the connections it shut down. Thread-safe to ``stop``."""

    def __init__(self, router: zmq.Socket[bytes], max_pending: int, handshake_s: float) -> None:
        """``router``: bound to a tcp:// endpoint. Raises ValueError for ``max_pending < 1``."""
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        self._local_port = int(port)
        self._max_pending = max_pending
        self._forget_s = handshake_s + 1.0
        self._monitor = router.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
        )
        self._fds: dict[int, float] = {}  # fd -> when it was accepted
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="kvtier-handshake-guard", daemon=True
        )
        self.num_cut = 0
        self._logged_at = float("-inf")
        self.max_seen_pending = 0  # the most pending connections one sweep saw (tests)

    def start(self) -> HandshakeGuard:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._monitor.close(linger=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            timeout = int(SWEEP_S * 1000) if self._fds else _IDLE_POLL_MS
            if self._monitor.poll(timeout):
                while True:  # every event already queued, then one sweep
                    try:
                        frames = self._monitor.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    event, value = struct.unpack("=HI", frames[0][:6])
                    if event == zmq.EVENT_ACCEPTED:
                        self._fds[value] = time.monotonic()
                    else:
                        self._fds.pop(value, None)
            if self._fds:
                self._sweep()

    def _sweep(self) -> None:
        now = time.monotonic()
        pending: list[tuple[int, int]] = []  # (bytes received, fd)
        for fd, since in list(self._fds.items()):
            state = self._pending_bytes(fd) if now - since < self._forget_s else None
            if state is None:
                del self._fds[fd]
            else:
                pending.append((state, fd))
        self.max_seen_pending = max(self.max_seen_pending, len(pending))
        excess = len(pending) - self._max_pending
        if excess <= 0:
            return
        pending.sort(reverse=True)  # the peers holding the most first
        for _, fd in pending[:excess]:
            if self._cut(fd):
                self.num_cut += 1
            self._fds.pop(fd, None)
        if now - self._logged_at >= 1.0:  # a flood would otherwise log every sweep
            log.warning(
                "cut %d ZMQ connections still in their handshake so far (over %d pending at once)",
                self.num_cut,
                self._max_pending,
            )
            self._logged_at = now

    def _pending_bytes(self, fd: int) -> int | None:
        """The bytes ``fd`` received while pending; None when it is not (or no longer) a
        pending connection of this daemon."""
        sock = self._ours(fd)
        if sock is None:
            return None
        with sock:
            counts = tcp_bytes(sock)
        if counts is None or counts[0] > GREETING_BYTES:
            return None
        return counts[1]

    def _cut(self, fd: int) -> bool:
        sock = self._ours(fd)
        if sock is None:
            return False
        with sock:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                return False
        return True

    def _ours(self, fd: int) -> socket.socket | None:
        """A duplicate of ``fd`` when it is a TCP connection accepted on the daemon's port."""
        try:
            dup = os.dup(fd)
        except OSError:
            return None
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            return None
        try:
            if (
                sock.type == socket.SOCK_STREAM
                and sock.family in (socket.AF_INET, socket.AF_INET6)
                and sock.getsockname()[1] == self._local_port
            ):
                sock.getpeername()  # connected, not a listener
                return sock
        except OSError:
            pass
        sock.close()
        return None
