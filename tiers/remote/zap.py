"""Connection-level authentication of the daemon's ZMQ socket (ZAP, ZeroMQ RFC 27).

Why: libzmq hands a multipart message to the application only once all of its frames have
arrived, so a check of the request header's token comes after the whole message is in
memory; a peer without a token could make the daemon buffer gigabytes (one 3 GiB multipart
put was buffered whole before its UNAUTHORIZED reply). With the PLAIN mechanism on the
ROUTER socket, libzmq asks this handler during the ZMTP handshake, before the peer may send
any message: a password that is not a known token ends the connection there. What an
unauthenticated peer can make the daemon hold is then one handshake command, which libzmq
caps at the socket's ``MAXMSGSIZE`` (``zmq_max_msg_bytes``, ~260 KiB), for at most the
handshake interval; ``guard`` caps how many peers may be at that stage at once
(``tiers.remote.handshake_guard``).

PLAIN carries the token as the password (username ``kvtier``), in the clear like the
request headers do; an open (token-less) daemon accepts any password. Every request is
still authenticated by its own header token (``OpHandler.parse``).

A refusal is counted (``num_denied``, the daemon's ``kvtier_server_handshakes_denied_total``)
and logged as one WARNING per peer address at most every ``WARN_INTERVAL_S`` (a client retrying
a wrong token reconnects every few seconds), naming the address, never the password. The
client learns of it from its socket monitor (libzmq's ``EVENT_HANDSHAKE_FAILED_AUTH``, the
ERROR command's 400): ``tiers.remote.conn`` says "token refused", not "not reachable".

Thread-safe: the handler runs on its own thread with its own REP socket; ``start`` before the
ROUTER binds, ``stop`` before the context terminates (it also stops the ``guard``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from tiers.remote.handshake_guard import HandshakeGuard

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27: one handler per context
ZAP_DOMAIN = b"kvtier"
PLAIN_USERNAME = b"kvtier"
WARN_INTERVAL_S = 60.0  # one refusal WARNING per peer address at most this often
_MAX_WARNED_PEERS = 4096  # addresses remembered for that (a scan of many: forgotten in bulk)

log = logging.getLogger(__name__)


def plain_password(token: str | None) -> bytes:
    """The PLAIN password a client presents: its token, or a placeholder for an open daemon
    (PLAIN refuses an empty one). Raises ValueError for a token PLAIN cannot carry."""
    raw = (token or "open").encode()
    if len(raw) > 255:
        raise ValueError("a token must be at most 255 bytes")
    return raw


def secure_client(sock: zmq.Socket[bytes], token: str | None) -> None:
    """Set the PLAIN credentials ``kvtier cache-server`` expects on a client socket (before
    connect)."""
    sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USERNAME)
    sock.setsockopt(zmq.PLAIN_PASSWORD, plain_password(token))


class ZapHandler:
    """Answers libzmq's ZAP requests for one context: 200 for a password ``accept`` takes
    (its tenant name becomes the connection's User-Id), 400 for anything else.
    ``accept(password) -> tenant name | None`` must not raise and must be fast."""

    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], accept: Callable[[bytes], str | None]
    ) -> None:
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._accept = accept
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-zap", daemon=True)
        self.num_denied = 0  # handshakes refused (the admin port's metric, tests)
        self.handshake_guard: HandshakeGuard | None = None
        self._warned: dict[bytes, tuple[float, int]] = {}  # address -> (last WARNING, since)

    def guard(self, router: zmq.Socket[bytes], max_pending: int, handshake_s: float) -> None:
        """Cap ``router``'s connections still in their handshake at ``max_pending``
        (``HandshakeGuard``; a tcp:// router after bind, else nothing to do)."""
        if router.getsockopt_string(zmq.LAST_ENDPOINT).startswith("tcp://"):
            self.handshake_guard = HandshakeGuard(router, max_pending, handshake_s).start()

    def start(self) -> ZapHandler:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self.handshake_guard is not None:
            self.handshake_guard.stop()
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            frames = self._sock.recv_multipart()
            # version, request id, domain, address, routing id, mechanism, credentials...
            version, request_id = frames[0], frames[1] if len(frames) > 1 else b""
            tenant, why = None, "not a kvtier PLAIN client"
            if (
                len(frames) == 8
                and frames[2] == ZAP_DOMAIN
                and frames[5] == b"PLAIN"
                and frames[6] == PLAIN_USERNAME
            ):
                tenant, why = self._accept(frames[7]), "token not in --tokens"
            if tenant is None:
                self.num_denied += 1
                self._sock.send_multipart([version, request_id, b"400", b"unknown token", b"", b""])
                self._warn(frames[3] if len(frames) > 3 else b"", why)
            else:
                self._sock.send_multipart(
                    [version, request_id, b"200", b"OK", tenant.encode(), b""]
                )

    def _warn(self, address: bytes, why: str) -> None:
        """Log a refusal of ``address`` (the peer's IP, from the ZAP request): the first at
        once, then at most one WARNING per ``WARN_INTERVAL_S`` with the count since."""
        now = time.monotonic()
        last, since = self._warned.get(address, (float("-inf"), 0))
        since += 1
        if now - last < WARN_INTERVAL_S:
            self._warned[address] = (last, since)
            return
        if len(self._warned) >= _MAX_WARNED_PEERS:
            self._warned.clear()
        self._warned[address] = (now, 0)
        peer = address.decode(errors="replace") or "an unknown address"
        log.warning(
            "refused %d ZMQ connection(s) from %s in the handshake: %s "
            "(at most one such warning per address every %.0f s)",
            since,
            peer,
            why,
            WARN_INTERVAL_S,
        )


def secure_server(sock: zmq.Socket[bytes], handshake_s: float) -> None:
    """Make ``sock`` (the daemon's ROUTER, before bind) a PLAIN server checked by the
    context's ``ZapHandler``; a peer that has not finished the handshake within
    ``handshake_s`` is dropped."""
    sock.setsockopt(zmq.PLAIN_SERVER, 1)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(handshake_s * 1000)))
