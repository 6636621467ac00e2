"""The cache daemon core: a ZMQ ROUTER loop in front of one ``HierarchicalStore``, shared by
many engines.

Threads: the loop thread owns the ROUTER socket (ZMQ sockets are not thread-safe); it receives
whole multipart requests and parses them (``OpHandler.parse``: header, token, keys, limits;
a refusal is answered at once). A get or lookup the host tier can serve whole is answered on
the loop thread too (``OpHandler.serve_inline``: tens of microseconds, cheaper than the
hand-off); everything else goes to a worker pool running ``OpHandler.run``, whose replies the
loop sends (a pipe wakes it). Workers never touch a socket. Replies may leave out of order;
clients match them by request id. Same-host clients that attached a shared-memory segment may
move to the doorbell (``cachestore.server.doorbell``): a Unix socket with one thread per connection
that parses and serves its requests itself, bound to the tenant that said hello.

Contracts:
- Every request gets exactly one reply, an error reply for anything malformed; nothing a
  client sends can raise out of the loop. A store failure is an ``INTERNAL`` reply (a miss to
  the client), never a crash.
- A put is acknowledged only after the store's ``put_many`` wrote every payload of it (with
  ``StoreConfig.write_through_to``: after the durable tier committed it), and a payload reaches
  the store only whole (ZMQ delivers multipart messages atomically) and after its checksum and
  block format matched.
- Tenants are enforced in the handler: a client key ``prefix/hex`` is stored as
  ``tenant/prefix/hex``.
- ``request_stop`` (thread-safe, signal-safe) drains: requests already received finish and are
  answered, new ones get ``SHUTTING_DOWN``, then sockets and segments close. ``drain_problem``
  then says whether that took longer than ``drain_timeout_s`` or the loop failed (None: a
  clean drain); ``kvtier cache-server`` exits non-zero on it. The store is the caller's:
  ``CacheServer`` never closes it.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import zmq

from cachestore.server.config import ServerConfig, is_loopback
from cachestore.server.doorbell import Doorbell
from cachestore.server.leases import LeaseOffer
from cachestore.server.ops import OpHandler
from cachestore.server.usage import NamespaceUsage
from cachestore.store.hierarchical import HierarchicalStore
from tiers.remote import shm
from tiers.remote.protocol import (
    OPEN_TENANT,
    ErrorCode,
    ProtocolError,
    Reply,
    RequestRecord,
    TokenTable,
    error_header,
    pack,
    zmq_max_msg_bytes,
)
from tiers.remote.zap import ZapHandler, secure_server

__all__ = ["CacheServer", "RequestRecord", "ServerConfig", "is_loopback"]
# The loop spins (``spin_us``) for the next request only after passes that moved at most this
# many payload bytes (see ``_loop``).
SPIN_MAX_BYTES = 256 << 10
_SHUTTING_DOWN = pack(error_header(-1, ErrorCode.SHUTTING_DOWN, "daemon is shutting down"))


class CacheServer:
    """Serve ``store`` on ``config.url``. Without ``tokens`` only a loopback bind is allowed.

    Raises ValueError at construction for an open (token-less) daemon on a public address.
    ``serve_forever`` blocks the calling thread; ``start`` runs it on a thread (tests).
    ``usage`` is the per-tenant accounting; pass the one whose ``remove`` the store got as
    ``on_drop`` so that blocks the store drops stop counting against quotas.
    """

    def __init__(
        self,
        config: ServerConfig,
        store: HierarchicalStore,
        tokens: TokenTable | None = None,
        on_request: Callable[[RequestRecord], None] | None = None,
        usage: NamespaceUsage | None = None,
    ) -> None:
        if tokens is None and not is_loopback(config.url):
            raise ValueError(
                f"refusing to serve {config.url} without --tokens: an open daemon binds loopback only"
            )
        self.config = config
        self.store = store
        # Stored as ``tenant/`` + the client's key; a keyed block carries the client's key.
        store.scope_block_keys(1)
        self._segments = shm.AttachedSegments(config.max_shm_attached, config.max_shm_segment_bytes)
        shm_on = config.shm_enabled and shm.available()
        self._tokens = tokens
        self._open_listeners(shm_on, tokens is None or tokens.one_open_namespace())
        self.zap: ZapHandler | None = None  # while serving: the ZMQ handshake's token check
        self._handler = OpHandler(
            store=store,
            usage=usage if usage is not None else NamespaceUsage(),
            limits=config.limits,
            authenticate=tokens.authenticate if tokens else (lambda _t: OPEN_TENANT),
            segments=self._segments if shm_on else None,
            on_request=on_request,
            access_log_path=config.access_log_path,
            offer_doorbell=self._bell.offer if self._bell is not None else None,
            offer_stream=self._stream.offer if self._stream is not None else None,
        )
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.bound_url: str | None = None
        self.inflight = 0
        # Once serve_forever returned: None after a clean drain, else why it was not.
        self.drain_problem: str | None = None

    def _open_listeners(self, shm_on: bool, one_namespace: bool) -> None:
        """The same-host doorbell (with shared memory), its leases (a slab of one namespace)
        and the TCP stream, as ``config`` turns them on; each None when off."""
        config = self.config
        bell_on = shm_on and config.doorbell
        self._leases = (
            LeaseOffer.build(
                self.store, one_namespace, config.max_leased_bytes, config.max_leased_conn_bytes
            )
            if bell_on and config.leases and config.inline_reads
            else None
        )
        self._bell = _listener(config, config.doorbell_dir, self._leases) if bell_on else None
        stream_host = config.stream_host() if config.stream else None
        self._stream = (
            _listener(config, None, None, tcp=(stream_host, config.stream_port))
            if stream_host is not None
            else None
        )

    @property
    def handler(self) -> OpHandler:
        return self._handler

    @property
    def leases(self) -> LeaseOffer | None:
        """In-place reads offered to doorbell clients (None: never; ``budget`` has the gauge)."""
        return self._leases

    @property
    def handshakes_denied(self) -> int:
        """ZMQ connections refused in the handshake (a token not in ``tokens``) since start;
        the ZAP handler also logs them (``tiers.remote.zap``)."""
        return self.zap.num_denied if self.zap is not None else 0

    @property
    def stream(self) -> Doorbell | None:
        """The TCP stream listener (None when off); ``port`` is set while it runs."""
        return self._stream

    @property
    def doorbell(self) -> Doorbell | None:
        """The same-host doorbell (None when off); ``path`` is set while it runs."""
        return self._bell

    def start(self, timeout_s: float = 10.0) -> CacheServer:
        """Run ``serve_forever`` on a daemon thread; returns once bound. Raises RuntimeError."""
        errors: list[BaseException] = []

        def run() -> None:
            try:
                self.serve_forever()
            except BaseException as exc:  # surfaced to the starting thread, or in drain_problem
                errors.append(exc)
                self._ready.set()

        self._thread = threading.Thread(target=run, name="kvtier-cache-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or errors:
            why = str(errors[0]) if errors else f"not bound within {timeout_s:g} s"
            raise RuntimeError(f"cannot serve {self.config.url}: {why}")
        return self

    def request_stop(self) -> None:
        """Ask the loop to drain and exit. Thread-safe; callable from a signal handler."""
        self._stop.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the loop has exited and closed everything; True if it has."""
        return self._done.wait(timeout_s)

    def stop(self, timeout_s: float = 15.0) -> None:
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def serve_forever(self) -> None:
        ctx = zmq.Context()
        cpus = os.sched_getaffinity(0)  # this thread's, restored on pool threads (they inherit)
        if self.config.loop_cpu is not None:  # before the first socket starts the I/O thread
            ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, self.config.loop_cpu)
        # Tokens are checked in the ZMTP handshake, before a peer may send a message (libzmq
        # buffers a multipart message whole before the loop could look at its header).
        zap = self.zap = ZapHandler(ctx, self._zap_accept).start()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 1000)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its identity
        secure_server(router, self.config.zmq_handshake_s)
        # ZMQ drops a peer whose frame (or handshake command) exceeds this before it is
        # buffered; frames up to it get a clear TOO_LARGE reply from the handler instead.
        router.setsockopt(zmq.MAXMSGSIZE, zmq_max_msg_bytes(self.config.limits))
        replies: queue.SimpleQueue[tuple[bytes, Reply]] = queue.SimpleQueue()
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        pool = ThreadPoolExecutor(
            self.config.num_workers,
            thread_name_prefix="kvtier-worker",
            initializer=os.sched_setaffinity,
            initargs=(0, cpus),
        )
        try:
            router.bind(self.config.url)
            self.bound_url = router.getsockopt_string(zmq.LAST_ENDPOINT)
            zap.guard(router, self.config.max_pending_handshakes, self.config.zmq_handshake_s)
            for listener in (self._bell, self._stream):
                if listener is not None:
                    try:
                        listener.start(self._handler)
                    except OSError:
                        pass  # not offered: its clients stay on ZMQ
            self._ready.set()
            if self.config.loop_cpu is not None:  # this thread only (Linux: pid 0 = caller)
                os.sched_setaffinity(0, {self.config.loop_cpu})
            self._loop(router, pool, replies, wake_r, wake_w)
        except BaseException as exc:
            self.drain_problem = f"the server loop failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            for listener in (self._bell, self._stream):  # each thread finishes its request
                if listener is not None:  # before the segments close
                    listener.stop(self.config.drain_timeout_s)
            if self._leases is not None:  # every lease went with its connection
                self._leases.close()
            pool.shutdown(wait=True)
            self._flush(router, replies)
            router.close(linger=1000)
            zap.stop()
            ctx.term()
            os.close(wake_r)
            os.close(wake_w)
            self._segments.close()
            self._handler.close()
            self._done.set()

    def _zap_accept(self, password: bytes) -> str | None:
        """The tenant of a ZMQ handshake's PLAIN password (None: refused); any for an open
        daemon."""
        if self._tokens is None:
            return OPEN_TENANT.name
        try:
            return self._tokens.authenticate(password.decode()).name
        except (ProtocolError, UnicodeDecodeError):
            return None

    def _loop(
        self,
        router: zmq.Socket[bytes],
        pool: ThreadPoolExecutor,
        replies: queue.SimpleQueue[tuple[bytes, Reply]],
        wake_r: int,
        wake_w: int,
    ) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake_r, zmq.POLLIN)
        drain_deadline: float | None = None
        spin_s = self.config.spin_us * 1e-6
        busy_until = 0.0  # poll without blocking until then (a client's next request is near)

        def finish(identity: bytes, future: Any) -> None:
            reply = future.result()  # OpHandler.run never raises
            replies.put((identity, reply))
            os.write(wake_w, b"x")

        while True:
            if self._stop.is_set() and drain_deadline is None:
                drain_deadline = time.monotonic() + self.config.drain_timeout_s
            if drain_deadline is not None and self._drained(drain_deadline):
                return
            if time.perf_counter() < busy_until:
                events = dict(poller.poll(0))
                if not events:
                    os.sched_yield()
                    continue
            else:
                events = dict(poller.poll(50))
            moved = 0  # payload bytes received and sent in this pass
            if wake_r in events:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
                moved += self._flush(router, replies)
            if router in events:
                moved += self._receive(router, pool, drain_deadline is not None, finish)
            if events:
                # Spin for the next request only after small messages: one that follows a
                # large transfer is at least that transfer away, and the spin would take the
                # CPU from the ZMQ I/O thread still moving the bytes (2 shared cores).
                busy_until = time.perf_counter() + spin_s if moved <= SPIN_MAX_BYTES else 0.0

    def _drained(self, drain_deadline: float) -> bool:
        """Whether a drain is over: nothing in flight, or past ``drain_deadline`` (then the
        requests left are ``drain_problem``; the pool still finishes them)."""
        if self.inflight and time.monotonic() <= drain_deadline:
            return False
        if self.inflight:  # their clients may be gone
            self.drain_problem = (
                f"{self.inflight} requests still in flight after "
                f"drain_timeout_s ({self.config.drain_timeout_s} s)"
            )
        return True

    def _receive(
        self,
        router: zmq.Socket[bytes],
        pool: ThreadPoolExecutor,
        draining: bool,
        finish: Callable[[bytes, Any], None],
    ) -> int:
        """Take up to 64 requests off ``router`` (a bounded batch, so replies keep flowing
        under load): each refused while ``draining``, answered inline when it can be, else
        handed to ``pool`` (``finish`` queues its reply). Returns the payload bytes moved."""
        moved = 0
        for _ in range(64):
            try:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            identity = frames[0].bytes
            moved += sum(len(f) for f in frames[2:])
            if draining:
                router.send_multipart([identity, _SHUTTING_DOWN])
                continue
            parsed = self._handler.parse(frames[1:])
            if isinstance(parsed, Reply):  # refused: no store work to hand off
                _send(router, identity, parsed, copy=False)
                continue

            def send(reply: Reply, ident: bytes = identity) -> None:
                nonlocal moved
                moved += _send(router, ident, reply, copy=False)

            # Host blocks leave zero copy, lent (pinned) until ZMQ has sent them.
            if self.config.inline_reads and self._handler.serve_inline(parsed, send, lend=True):
                continue
            self.inflight += 1
            fut = pool.submit(self._handler.run, parsed)
            fut.add_done_callback(partial(finish, identity))
        return moved

    def _flush(
        self, router: zmq.Socket[bytes], replies: queue.SimpleQueue[tuple[bytes, Reply]]
    ) -> int:
        """Send the pool's finished replies; returns their payload bytes."""
        moved = 0
        while True:
            try:
                identity, reply = replies.get_nowait()
            except queue.Empty:
                return moved
            self.inflight -= 1
            moved += _send(router, identity, reply, copy=False)


def _listener(
    config: ServerConfig,
    path_dir: str | None,
    leases: LeaseOffer | None,
    tcp: tuple[str, int] | None = None,
) -> Doorbell:
    """A framed-connection listener of ``config``'s limits: the doorbell (a Unix socket in
    ``path_dir``) or, with ``tcp``, the stream."""
    return Doorbell(
        config.limits,
        config.max_doorbell_conns,
        path_dir,
        config.inline_reads,
        config.spin_us * 1e-6,
        leases,
        tcp=tcp,
        attach_timeout_s=config.attach_timeout_s,
    )


def _send(router: zmq.Socket[bytes], identity: bytes, reply: Reply, copy: bool) -> int:
    """Send one reply. ``copy``: ZMQ copies the payloads before returning; else it sends them
    zero copy, holding a reference to each payload until its bytes are on the wire (owned
    bytes, or host-tier views lent by ``HostReads.lend``, unpinned when released)."""
    try:
        router.send_multipart([identity, pack(reply.header), *reply.payloads], copy=copy)
    except zmq.ZMQError:
        pass  # the peer is gone (ROUTER drops silently; this is belt and braces)
    return sum(len(p) for p in reply.payloads)
