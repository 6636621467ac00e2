"""The remote tier's connections to ``kvtier cache-server``: one per calling thread.

- One DEALER socket per thread (ZMQ sockets are not thread-safe), created lazily, reused across
  calls, replaced after any timeout (a fresh socket drops stale replies); for
  ``retry_interval_s`` after a failure the thread fails fast without waiting.
- ``call`` pipelines: every request is sent before the first reply is read; replies are matched
  by request id and may come back in any order. A reply with an unknown id (a request that
  already timed out) is dropped.
- Same host: the first request of a thread sends a ``hello`` naming a fresh shared-memory
  segment (``tiers.remote.shm``); if the daemon maps it, payloads can move through it. ``grow``
  replaces it with a larger one (a new hello).
- Doorbell (``cachestore.server.doorbell``): when the hello reply offers one, the thread connects to
  the daemon's Unix socket with the one-time secret and sends its requests there (same
  headers, payloads still in the segment). A refused or broken doorbell is dropped and the
  call goes over ZMQ instead, transparently; only a timeout is an error (as on ZMQ).
- TCP stream (``cachestore.server.doorbell``, ``tcp``): a thread without a segment (another host,
  shm off) asks for the daemon's TCP stream in its hello (``use_stream``); when offered, it
  connects to that port on the url's host with the one-time secret and sends its requests
  and payload frames there (one blocking socket, no ZMQ I/O threads). A broken stream is
  dropped and the call goes over ZMQ; the next call says hello again (a restarted daemon
  offers a new stream).
- Leases (``cachestore.server.leases``): with ``use_leases`` the attach asks for the daemon's host
  slab; if it comes (a sealed memfd over SCM_RIGHTS), ``Bell.slab`` is a read-only mapping
  of it, and gets ask for leases (``lease: true``): a reply may then carry ``slab_offsets``
  instead of copies (a miss or a cap reached: copies, as before). The first request of the
  thread's next call on the doorbell carries ``release: true``; closing the doorbell (or the
  process dying) releases the rest on the daemon's side.
- A refused token: the daemon's ZAP handler ends the handshake with an ERROR (400) and the
  socket never becomes writable (``IMMEDIATE``), which alone reads as an unreachable daemon.
  Each socket therefore has a monitor for libzmq's ``EVENT_HANDSHAKE_FAILED_AUTH``: a waiting
  call fails at once with "token refused (authentication failed)" instead of "not reachable"
  at its timeout, and so does the fail-fast window after it.

Thread-safe (per-thread connections); ``close`` must not race with calls in flight.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import parse_monitor_message

from tiers.base import TierError, Value
from tiers.remote import shm
from tiers.remote.bell import Bell
from tiers.remote.protocol import (
    PROTOCOL_VERSION,
    ZMQ_FRAME_BYTES,
    ErrorCode,
    is_loopback,
    pack,
    split_frames,
    url_host,
)
from tiers.remote.zap import secure_client


class ShmLost(TierError):
    """The daemon no longer maps this thread's segment (it restarted): hello, then retry."""


_Replies = list[tuple[dict[str, Any], list[memoryview]]]
# A ZMQ call spins for its replies only when neither its request frames nor the last reply of
# the same op carried more payload bytes than this (``Connections._call_zmq``).
SPIN_MAX_BYTES = 256 << 10
# Names of the sockets' monitor endpoints: unique in the process (pyzmq's default, the socket's
# descriptor number, can be reused by a new socket before libzmq unbinds the old endpoint).
_MONITOR_IDS = itertools.count()


class Conn:
    """One thread's socket, segment, doorbell and negotiated limits."""

    def __init__(self, sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self.monitor = monitor  # sock's EVENT_HANDSHAKE_FAILED_AUTH events
        self.refused = False  # the daemon refused our token (seen on ``monitor``)
        self.next_id = 1
        self.hello_done = False
        self.segment: shm.ShmSegment | None = None
        self.bell: Bell | None = None
        self.max_keys = 1024
        self.max_request_bytes = 1 << 30
        self.reply_bytes: dict[str, int] = {}  # op -> payload bytes of its last ZMQ reply

    def close(self, linger_ms: int) -> None:
        """Unmap the segment, close the doorbell, the monitor and the socket (``linger_ms``:
        how long unsent messages may still go out)."""
        if self.segment is not None:
            self.segment.close()
        if self.bell is not None:
            self.bell.close()
        self.monitor.close(linger=0)
        self.sock.close(linger=linger_ms)


class Connections:
    """Per-thread connections to one daemon, with the hello/shm handshake."""

    def __init__(
        self,
        url: str,
        token: str,
        timeout_s: float,
        use_shm: bool,
        shm_bytes: int,
        max_shm_bytes: int,
        retry_interval_s: float,
        use_doorbell: bool = True,
        spin_s: float = 0.0,
        use_leases: bool = True,
        use_stream: bool = True,
    ) -> None:
        self.url = url
        self.use_doorbell = use_doorbell
        self.use_stream = use_stream and url.startswith("tcp://")
        self.use_leases = use_leases
        self.spin_s = spin_s
        # Over a real network a reply takes longer than any useful spin: poll only locally.
        self._zmq_spin_s = spin_s if is_loopback(url) else 0.0
        self._token = token
        self.timeout_s = timeout_s
        self.use_shm = use_shm
        self.shm_bytes = shm_bytes
        self.max_shm_bytes = max_shm_bytes
        self.retry_interval_s = retry_interval_s
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._conns: list[Conn] = []
        self._host_id = shm.host_id()
        self._closed = False

    def get(self) -> Conn:
        """This thread's connection (made, and said hello on, at first use). Raises TierError
        when closed, or while failing fast after a timeout."""
        if self._closed:
            raise TierError("remote tier is closed")
        conn: Conn | None = getattr(self._local, "conn", None)
        if conn is None:
            if time.monotonic() < getattr(self._local, "down_until", 0.0):
                if getattr(self._local, "refused", False):
                    raise TierError(f"{self._refused_text()}, retrying shortly")
                raise TierError(f"cache server {self.url} unavailable (retrying shortly)")
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue requests for a server not there
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            secure_client(sock, self._token)  # the daemon's ZAP checks it before any message
            monitor = sock.get_monitor_socket(  # before connect: the first handshake's events
                zmq.EVENT_HANDSHAKE_FAILED_AUTH, f"inproc://kvtier-conn-{next(_MONITOR_IDS)}"
            )
            sock.connect(self.url)
            conn = Conn(sock, monitor)
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        if not conn.hello_done:
            self._hello(conn)
        return conn

    def _hello(self, conn: Conn, size: int | None = None) -> None:
        segment = None
        if self.use_shm:
            try:
                segment = shm.ShmSegment.create(size or self.shm_bytes)
            except OSError:
                segment = None
        header: dict[str, Any] = {"op": "hello", "host_id": self._host_id}
        if segment is not None:
            header["shm"] = segment.name
            header["doorbell"] = self.use_doorbell and conn.bell is None
        else:
            header["stream"] = self.use_stream and conn.bell is None
        if conn.segment is not None:
            header["replaces"] = conn.segment.name  # the daemon unmaps the old one now
        conn.hello_done = True  # _call below must not recurse into another hello
        try:
            ((reply, _),) = self.call(conn, [(header, [])])
        except BaseException:
            conn.hello_done = False
            if segment is not None:
                segment.close()
            raise
        conn.max_keys = reply["max_keys_per_request"]
        conn.max_request_bytes = reply["max_request_bytes"]
        if conn.segment is not None:
            conn.segment.close()
        conn.segment = None
        if segment is not None:
            segment.unlink()  # both sides hold a mapping; nothing stays in /dev/shm
            if reply["shm"]:
                conn.segment = segment
            else:
                segment.close()
        offered = reply.get("doorbell")
        port = reply.get("stream_port")
        address: str | tuple[str, int] | None = None
        if conn.bell is None and conn.segment is not None and isinstance(offered, str):
            address, secret = offered, reply.get("doorbell_secret")
        elif (
            conn.bell is None and conn.segment is None and isinstance(port, int) and self.use_stream
        ):
            address, secret = (url_host(self.url), port), reply.get("stream_secret")
        if address is not None:
            try:
                conn.bell = Bell(
                    address, str(secret), self.timeout_s, self.spin_s, want_slab=self.use_leases
                )
            except OSError:
                conn.bell = None  # another mount namespace, a firewall, refused: ZMQ it is

    def grow(self, conn: Conn, needed: int) -> None:
        size = min(max(needed, 2 * (conn.segment.size if conn.segment else 0)), self.max_shm_bytes)
        if conn.segment is not None and size > conn.segment.size:
            self._hello(conn, size)

    def transport(self) -> str:
        """What this thread's next call goes over: "doorbell" ("doorbell+slab" when it maps the
        daemon's host slab), "zmq" or "none" (no connection yet). For tests and diagnostics."""
        conn: Conn | None = getattr(self._local, "conn", None)
        if conn is None:
            return "none"
        if conn.bell is None:
            return "zmq"
        if conn.bell.tcp:
            return "stream"
        return "doorbell+slab" if conn.bell.slab is not None else "doorbell"

    def call(self, conn: Conn, requests: list[tuple[dict[str, Any], list[Value]]]) -> _Replies:
        """Send every request, then collect every reply (pipelined), in request order; reply
        payloads are memoryviews valid until this thread's next call. Over the doorbell when
        the thread has one (a broken doorbell: over ZMQ). Raises TierError (ShmLost when the
        daemon forgot this thread's segment)."""
        if conn.bell is not None:
            try:
                return _check(conn, self._call_bell(conn, conn.bell, requests))
            except (BlockingIOError, TimeoutError):
                self._reset(conn)
                raise TierError(
                    f"cache server {self.url} timed out after {self.timeout_s}s"
                ) from None
            except OSError:  # EOF, reset, refused: the daemon went away or restarted
                if conn.bell.tcp:  # (a stream is only ever made without a segment)
                    conn.hello_done = False  # a stream costs one hello: ask again next call
                conn.bell.close()
                conn.bell = None
        return _check(conn, self._call_zmq(conn, requests))

    def _call_bell(
        self, conn: Conn, bell: Bell, requests: list[tuple[dict[str, Any], list[Value]]]
    ) -> _Replies:
        messages = []
        for header, payloads in requests:
            msg = {"v": PROTOCOL_VERSION, "id": conn.next_id, "token": self._token, **header}
            if bell.leased:  # the previous call's values are done with (the Tier contract)
                msg["release"] = True
                bell.leased = False
            if bell.slab is not None and header.get("op") == "get":
                msg["lease"] = True
            conn.next_id += 1
            messages.append((pack(msg), payloads))
        out: _Replies = []
        for frames in bell.call(messages):
            reply = msgpack.unpackb(frames[0], raw=False)
            bell.leased = bell.leased or "slab_offsets" in reply
            out.append((reply, [memoryview(f) for f in frames[1:]]))
        return out

    def _call_zmq(self, conn: Conn, requests: list[tuple[dict[str, Any], list[Value]]]) -> _Replies:
        deadline = time.monotonic() + self.timeout_s
        ids: list[int] = []
        ops: dict[int, str] = {}
        # Spin for the replies only when no large message crosses either way: a reply behind
        # megabytes of frames is that transfer away, and spinning would take the CPU from
        # this process's ZMQ I/O thread that moves them (2 shared cores).
        spin = sum(len(p) for _, ps in requests for p in ps) <= SPIN_MAX_BYTES and all(
            conn.reply_bytes.get(h.get("op", ""), 0) <= SPIN_MAX_BYTES for h, _ in requests
        )
        heads: list[bytes] = []
        for header, _ in requests:  # all checked before any is sent: a local error
            request_id = conn.next_id
            conn.next_id += 1
            ids.append(request_id)
            ops[request_id] = str(header.get("op"))
            heads.append(
                pack({"v": PROTOCOL_VERSION, "id": request_id, "token": self._token, **header})
            )
            if len(heads[-1]) > ZMQ_FRAME_BYTES:  # the daemon would drop the connection
                raise TierError(
                    f"a {header.get('op')} header of {len(heads[-1])} bytes is over "
                    f"ZMQ's {ZMQ_FRAME_BYTES}-byte frame; use fewer keys a "
                    f"request (batch_keys)"
                )
        try:
            for head, (_, payloads) in zip(heads, requests, strict=True):
                parts = [head, *split_frames(payloads)]
                try:  # the common case: the pipe has room, no poll round trip needed
                    conn.sock.send_multipart(parts, zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    self._wait_out(conn, deadline)
                    conn.sock.send_multipart(parts, copy=False)
            replies: dict[int, tuple[dict[str, Any], list[memoryview]]] = {}
            while len(replies) < len(ids):
                if not self._wait_in(conn.sock, deadline, spin):
                    if _refused(conn):  # a reconnect to a daemon that took another token
                        raise TierError(self._refused_text())
                    raise TierError(f"cache server {self.url} timed out after {self.timeout_s}s")
                frames = conn.sock.recv_multipart(copy=False)
                reply = msgpack.unpackb(frames[0].buffer, raw=False)
                if reply.get("id") in ids:
                    replies[reply["id"]] = (reply, [f.buffer for f in frames[1:]])
                    conn.reply_bytes[ops[reply["id"]]] = sum(len(f) for f in frames[1:])
                elif reply.get("id") == -1:  # an error the daemon could not tie to an id
                    raise TierError(f"cache server refused a request: {reply.get('error')}")
        except TierError:
            self._reset(conn)
            raise
        except zmq.ZMQError as exc:
            self._reset(conn)
            raise TierError(f"cache server {self.url}: {exc}") from exc
        return [replies[i] for i in ids]

    def _wait_out(self, conn: Conn, deadline: float) -> None:
        """Block until ``conn``'s socket takes a message (with ``IMMEDIATE``: once a handshake
        succeeded). Raises TierError: "token refused" as soon as the monitor reports the
        daemon's refusal, else "not reachable" at ``deadline``."""
        poller = zmq.Poller()
        poller.register(conn.sock, zmq.POLLOUT)
        poller.register(conn.monitor, zmq.POLLIN)
        while True:
            events = dict(poller.poll(_ms_left(deadline)))
            if conn.sock in events:
                return
            if _refused(conn):
                raise TierError(self._refused_text())
            if not events:
                raise TierError(f"cache server {self.url} not reachable")

    def _refused_text(self) -> str:
        return f"cache server {self.url}: token refused (authentication failed)"

    def _wait_in(self, sock: zmq.Socket[bytes], deadline: float, spin: bool) -> bool:
        """Whether a reply arrived before ``deadline``: polled without blocking for up to
        ``spin_s`` if ``spin`` (yielding between polls; a blocked thread's wake-up costs tens
        of us here), then a blocking poll."""
        if spin and self._zmq_spin_s > 0:
            end = time.perf_counter() + self._zmq_spin_s
            while time.perf_counter() < end:
                if sock.poll(0, zmq.POLLIN):
                    return True
                os.sched_yield()
        return bool(sock.poll(_ms_left(deadline), zmq.POLLIN))

    def _reset(self, conn: Conn) -> None:
        """Drop a socket that timed out; fail fast for ``retry_interval_s``."""
        with self._lock:
            if conn in self._conns:
                self._conns.remove(conn)
        conn.close(linger_ms=0)
        self._local.conn = None
        self._local.down_until = time.monotonic() + self.retry_interval_s
        self._local.refused = conn.refused  # the fail-fast error says so too

    def close(self) -> None:
        """Say bye for each shared segment, close every socket and the context. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns, self._conns = self._conns, []
        for conn in conns:
            if conn.segment is not None:
                try:  # let the daemon drop its mapping now rather than at LRU time
                    msg = {
                        "v": PROTOCOL_VERSION,
                        "id": 0,
                        "op": "bye",
                        "token": self._token,
                        "shm": conn.segment.name,
                    }
                    conn.sock.send(pack(msg), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            conn.close(linger_ms=100)  # the bye may still go out
        self._ctx.term()


def _check(conn: Conn, out: _Replies) -> _Replies:
    """Raise for the first error reply (ShmLost: hello again, then retry). ``PUT_RACED`` is
    not an error: another client's put of the same keys is writing them."""
    for reply, _ in out:
        code = reply.get("code", ErrorCode.INTERNAL)
        if code == ErrorCode.SHM_UNAVAILABLE:
            conn.hello_done = False  # the daemon restarted or forgot us: hello again next call
            raise ShmLost("cache server lost the shared-memory segment")
        if code == ErrorCode.PUT_RACED:  # a concurrent put of the same keys is storing them
            continue
        if code != ErrorCode.OK:
            raise TierError(f"cache server error {ErrorCode(code).name}: {reply.get('error')}")
    return out


def _refused(conn: Conn) -> bool:
    """Whether the daemon refused ``conn``'s token in a handshake (reads the monitor's queued
    events without blocking)."""
    while not conn.refused:
        try:
            frames = conn.monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        if parse_monitor_message(frames)["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            conn.refused = True
    return conn.refused


def _ms_left(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000))
