"""The cache daemon core: a ZMQ ROUTER loop in front of one store, shared by many engines.

Threads: the loop thread owns the ROUTER socket (ZMQ sockets are not thread-safe); it receives
whole multipart requests, hands each to a worker pool, and sends the replies workers queue
back (a pipe wakes the loop). Workers never touch a socket. Replies may leave out of order;
clients match them by request id.

Contracts:
- Every request gets exactly one reply, an error reply for anything malformed; nothing a
  client sends can raise out of the loop. A store failure is an ``INTERNAL`` reply (a miss to
  the client), never a crash.
- A put is acknowledged only after ``Backend.put_many`` returned for every payload of it, and a
  payload reaches the store only whole (ZMQ delivers multipart messages atomically) and after
  its checksum matched. Acknowledged = in the store; durable when the store writes through to
  LMDB (see ``cachestore.server_cli``).
- Tenants are enforced here: a client key ``prefix/hex`` is stored as ``tenant/prefix/hex``.
- ``request_stop`` (thread-safe, signal-safe) drains: requests already received finish and are
  answered, new ones get ``SHUTTING_DOWN``, then sockets, segments and the store close.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq

from cachestore import shm
from cachestore.server_protocol import (
    OPEN_TENANT,
    ErrorCode,
    ProtocolError,
    ServerLimits,
    Tenant,
    TokenTable,
    checksum,
    error_header,
    pack,
    unpack_request,
)
from tiers.base import Evicted, Value

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


class Backend(Protocol):
    """What the daemon needs from its store (``HierarchicalStore`` or one Tier via an adapter).

    Must be thread-safe; failures raise (any exception becomes an ``INTERNAL`` reply).
    """

    def lookup(self, keys: Sequence[str]) -> int: ...

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        """Values valid until ``release`` (or the next call) on the same thread."""

    def release(self) -> None:
        """The caller is done with the values of its last ``get_many``."""

    def put_many(self, items: Sequence[tuple[str, Value]]) -> list[Evicted]:
        """Store copies: the values (views of frames or of a client segment) die after it."""

    def delete_many(self, keys: Sequence[str]) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Reply:
    header: dict[str, Any]
    payloads: list[Value]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One served request, for metrics and the access log."""

    op: str
    namespace: str
    code: ErrorCode
    num_keys: int
    num_hits: int
    bytes_in: int
    bytes_out: int
    path: str  # "tcp" (payload frames) or "shm"
    seconds: float


class NamespaceUsage:
    """Bytes and keys each tenant stored through this daemon (for quotas and /stats).

    Counts what was put since the daemon started, minus deletes and evictions the store
    reported; keys a previous run left in LMDB are not counted until overwritten. Thread-safe;
    the quota check and the update are not one atomic step, so concurrent puts of one tenant
    may overshoot its quota by at most one request each.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key_bytes: dict[str, int] = {}
        self._tenant_bytes: dict[str, int] = {}
        self._tenant_keys: dict[str, int] = {}

    def delta(self, tenant: str, items: Sequence[tuple[str, int]]) -> int:
        with self._lock:
            return sum(size - self._key_bytes.get(k, 0) for k, size in items)

    def used(self, tenant: str) -> int:
        with self._lock:
            return self._tenant_bytes.get(tenant, 0)

    def add(self, tenant: str, items: Sequence[tuple[str, int]]) -> None:
        with self._lock:
            for key, size in items:
                old = self._key_bytes.get(key)
                self._key_bytes[key] = size
                self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + size - (old or 0)
                if old is None:
                    self._tenant_keys[tenant] = self._tenant_keys.get(tenant, 0) + 1

    def remove(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                size = self._key_bytes.pop(key, None)
                if size is not None:
                    tenant = key.split("/", 1)[0]
                    self._tenant_bytes[tenant] -= size
                    self._tenant_keys[tenant] -= 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {t: {"bytes": b, "keys": self._tenant_keys.get(t, 0)}
                    for t, b in sorted(self._tenant_bytes.items())}


_Op = Callable[[dict[str, Any], str, list[str], Sequence[Any], dict[str, Any]],
               tuple[dict[str, Any], list[Value]]]


class OpHandler:
    """Turns one request (frames after the identity) into one ``Reply``; never raises.

    Thread-safe: called from the worker pool. ``authenticate`` maps a token to a ``Tenant`` or
    raises ``ProtocolError``. ``segments`` is None when the shared-memory path is off.
    """

    def __init__(self, backend: Backend, limits: ServerLimits,
                 authenticate: Callable[[object], Tenant],
                 segments: shm.AttachedSegments | None,
                 on_request: Callable[[RequestRecord], None] | None = None,
                 access_log_path: str | None = None) -> None:
        self.backend = backend
        self.limits = limits
        self.usage = NamespaceUsage()
        self.host_id = shm.host_id()
        self._authenticate = authenticate
        self._segments = segments
        self._on_request = on_request
        self._log_lock = threading.Lock()
        self._log = open(access_log_path, "a", buffering=1) if access_log_path else None
        self._ops: dict[str, _Op] = {
            "hello": self._op_hello, "bye": self._op_bye, "lookup": self._op_lookup,
            "get": self._op_get, "put": self._op_put, "delete": self._op_delete,
            "stats": self._op_stats,
        }

    def close(self) -> None:
        if self._log is not None:
            with self._log_lock:
                self._log.close()
                self._log = None

    def handle(self, frames: Sequence[zmq.Frame | bytes]) -> Reply:
        start = time.perf_counter()
        request_id, op, tenant = -1, "?", "?"
        rec: dict[str, Any] = {"num_keys": 0, "num_hits": 0, "bytes_in": 0, "bytes_out": 0,
                               "path": "tcp", "keys": []}
        try:
            if len(frames) - 1 > self.limits.max_keys_per_request:
                raise ProtocolError(ErrorCode.BAD_FRAME, f"{len(frames)} frames is too many")
            header = unpack_request(_buffer(frames[0]), self.limits)
            request_id, op = header["id"], header["op"]
            who = self._authenticate(header.get("token"))
            tenant = who.name
            keys: list[str] = header.get("keys", [])
            who.check_keys(keys)
            rec["num_keys"], rec["keys"] = len(keys), keys
            if op not in ("put",) and len(frames) > 1:
                raise ProtocolError(ErrorCode.BAD_FRAME, f"{op} takes no payload frames")
            ikeys = [f"{tenant}/{k}" for k in keys]
            body, payloads = self._ops[op](header, tenant, ikeys, frames[1:], rec)
            reply = Reply({"id": request_id, "code": 0, "error": "", **body}, payloads)
            code = ErrorCode.OK
        except ProtocolError as exc:
            code, reply = exc.code, Reply(error_header(request_id, exc.code, exc.message), [])
        except Exception as exc:  # a store failure: the client sees a miss, the daemon lives
            code = ErrorCode.INTERNAL
            reply = Reply(error_header(request_id, code, f"store error: {exc!r}"[:500]), [])
        record = RequestRecord(op, tenant, code, rec["num_keys"], rec["num_hits"],
                               rec["bytes_in"], rec["bytes_out"], rec["path"],
                               time.perf_counter() - start)
        if self._on_request is not None:
            self._on_request(record)
        if self._log is not None and code == ErrorCode.OK and op in _LOGGED_OPS:
            line = json.dumps({"ts": round(time.time(), 6), "op": op, "namespace": tenant,
                               "keys": rec["keys"], "hits": rec["num_hits"]})
            with self._log_lock:
                if self._log is not None:
                    self._log.write(line + "\n")
        return reply

    # -- ops: each returns (reply fields, payload frames) ------------------------------------

    def _op_hello(self, header: dict[str, Any], tenant: str, ikeys: list[str],
                  frames: Sequence[Any], rec: dict[str, Any]) -> tuple[dict[str, Any], list[Value]]:
        shm_ok = False
        replaced = header.get("replaces")
        if isinstance(replaced, str) and self._segments is not None:
            self._segments.detach(replaced, tenant)  # the client grew its segment
        name = header.get("shm")
        if (isinstance(name, str) and self._segments is not None
                and header.get("host_id") == self.host_id):
            try:
                self._segments.attach(name, tenant)
                shm_ok = True
            except (OSError, ValueError):
                shm_ok = False  # another /dev/shm (container) or a bad name: frames it is
        lim = self.limits
        return {"shm": shm_ok, "namespace": tenant, "max_keys_per_request":
                lim.max_keys_per_request, "max_frame_bytes": lim.max_frame_bytes,
                "max_request_bytes": lim.max_request_bytes}, []

    def _op_bye(self, header: dict[str, Any], tenant: str, ikeys: list[str],
                frames: Sequence[Any], rec: dict[str, Any]) -> tuple[dict[str, Any], list[Value]]:
        name = header.get("shm")
        if isinstance(name, str) and self._segments is not None:
            self._segments.detach(name, tenant)
        return {}, []

    def _op_lookup(self, header: dict[str, Any], tenant: str, ikeys: list[str],
                   frames: Sequence[Any], rec: dict[str, Any]) -> tuple[dict[str, Any], list[Value]]:
        count = self.backend.lookup(ikeys) if ikeys else 0
        rec["num_hits"] = count
        return {"count": count}, []

    def _op_get(self, header: dict[str, Any], tenant: str, ikeys: list[str],
                frames: Sequence[Any], rec: dict[str, Any]) -> tuple[dict[str, Any], list[Value]]:
        try:
            return self._get(header, tenant, ikeys, rec)
        finally:
            self.backend.release()

    def _get(self, header: dict[str, Any], tenant: str, ikeys: list[str],
             rec: dict[str, Any]) -> tuple[dict[str, Any], list[Value]]:
        segment, offset, end = self._shm_region(header, tenant)
        values = self.backend.get_many(ikeys) if ikeys else []
        sizes: list[int] = []
        shm_offsets: list[int] = []
        payloads: list[Value] = []
        for value in values:
            if value is None:
                sizes.append(-1)
                shm_offsets.append(-1)
                continue
            size = len(value)
            sizes.append(size)
            rec["num_hits"] += 1
            rec["bytes_out"] += size
            if segment is not None and offset + size <= end:
                segment.buf[offset : offset + size] = value
                shm_offsets.append(offset)
                offset += size
                rec["path"] = "shm"
            else:
                shm_offsets.append(-1)
                # A memoryview from the store may die with this thread's next call: the reply
                # leaves from the loop thread later, so it must own its bytes.
                payloads.append(value if isinstance(value, bytes) else bytes(value))
        body: dict[str, Any] = {"sizes": sizes}
        if segment is not None:
            body["shm_offsets"] = shm_offsets
        return body, payloads

    def _op_put(self, header: dict[str, Any], tenant: str, ikeys: list[str],
                frames: Sequence[Any], rec: dict[str, Any]) -> tuple[dict[str, Any], list[Value]]:
        sizes: list[int] = header["sizes"]
        lim = self.limits
        if any(s > lim.max_frame_bytes for s in sizes) or sum(sizes) > lim.max_request_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE,
                                f"payload over the limit ({lim.max_frame_bytes} bytes per block, "
                                f"{lim.max_request_bytes} per request)")
        views: list[memoryview]
        if "shm_offsets" in header:
            segment, _, _ = self._shm_region(header, tenant)
            offsets = header["shm_offsets"]
            if segment is None:
                raise ProtocolError(ErrorCode.SHM_UNAVAILABLE, "unknown shared-memory segment")
            if (not isinstance(offsets, list) or len(offsets) != len(sizes) or not all(
                    isinstance(o, int) and 0 <= o and o + s <= segment.size
                    for o, s in zip(offsets, sizes, strict=True))):
                raise ProtocolError(ErrorCode.BAD_HEADER, "shm_offsets out of the segment")
            # No copy here: put_many copies into the store before we acknowledge, and the
            # client does not touch its segment until the acknowledgement.
            views = [segment.buf[o : o + s] for o, s in zip(offsets, sizes, strict=True)]
            rec["path"] = "shm"
        else:
            if len(frames) != len(sizes):
                raise ProtocolError(ErrorCode.BAD_FRAME,
                                    f"{len(frames)} payload frames for {len(sizes)} keys")
            views = [_buffer(f) for f in frames]
        for i, (view, size, digest) in enumerate(zip(views, sizes, header["checksums"], strict=True)):
            if len(view) != size or checksum(view) != digest:
                raise ProtocolError(ErrorCode.CHECKSUM_MISMATCH,
                                    f"payload {i} does not match its size/checksum; nothing stored")
        accounted = list(zip(ikeys, sizes, strict=True))
        quota = lim.max_namespace_bytes
        if quota is not None and self.usage.used(tenant) + self.usage.delta(tenant, accounted) > quota:
            raise ProtocolError(ErrorCode.QUOTA_EXCEEDED,
                                f"namespace {tenant!r} would exceed its quota of {quota} bytes")
        evicted = self.backend.put_many(list(zip(ikeys, views, strict=True))) if ikeys else []
        self.usage.add(tenant, accounted)
        self.usage.remove([e.key for e in evicted])
        rec["bytes_in"] = sum(sizes)
        return {"stored": len(ikeys), "evicted": len(evicted)}, []

    def _op_delete(self, header: dict[str, Any], tenant: str, ikeys: list[str],
                   frames: Sequence[Any], rec: dict[str, Any]) -> tuple[dict[str, Any], list[Value]]:
        deleted = self.backend.delete_many(ikeys) if ikeys else 0
        self.usage.remove(ikeys)
        return {"deleted": deleted}, []

    def _op_stats(self, header: dict[str, Any], tenant: str, ikeys: list[str],
                  frames: Sequence[Any], rec: dict[str, Any]) -> tuple[dict[str, Any], list[Value]]:
        mine = self.usage.snapshot().get(tenant, {"bytes": 0, "keys": 0})
        return {"stats": {"namespace": tenant, **mine}}, []

    def _shm_region(self, header: dict[str, Any], tenant: str
                    ) -> tuple[shm.ShmSegment | None, int, int]:
        name = header.get("shm")
        if not isinstance(name, str) or self._segments is None:
            return None, 0, 0
        segment = self._segments.get(name, tenant)
        if segment is None:
            raise ProtocolError(ErrorCode.SHM_UNAVAILABLE, "unknown shared-memory segment")
        start, length = header.get("shm_start", 0), header.get("shm_length", segment.size)
        if not (isinstance(start, int) and isinstance(length, int) and 0 <= start
                and 0 <= length and start + length <= segment.size):
            raise ProtocolError(ErrorCode.BAD_HEADER, "shm region out of the segment")
        return segment, start, start + length


_LOGGED_OPS = frozenset({"lookup", "get", "put", "delete"})


def _buffer(frame: zmq.Frame | bytes) -> memoryview:
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything the daemon core needs; mapped one-to-one from ``kvtier cache-server`` flags."""

    url: str = "tcp://127.0.0.1:5555"
    limits: ServerLimits = field(default_factory=ServerLimits)
    num_workers: int = 4
    shm_enabled: bool = True
    max_shm_attached: int = 256
    max_shm_segment_bytes: int = 4 << 30
    drain_timeout_s: float = 10.0
    access_log_path: str | None = None

    def __post_init__(self) -> None:
        if self.num_workers <= 0:
            raise ValueError("num_workers must be positive")
        if not self.url.startswith(("tcp://", "ipc://")):
            raise ValueError(f"url must be tcp://HOST:PORT or ipc://PATH, got {self.url!r}")


def is_loopback(url: str) -> bool:
    if url.startswith("ipc://"):
        return True
    host = url[len("tcp://") :].rsplit(":", 1)[0]
    return host in LOOPBACK_HOSTS or host.startswith("127.")


class CacheServer:
    """Serve ``backend`` on ``config.url``. Without ``tokens`` only a loopback bind is allowed.

    Raises ValueError at construction for an open (token-less) daemon on a public address.
    ``serve_forever`` blocks the calling thread; ``start`` runs it on a thread (tests).
    """

    def __init__(
        self,
        config: ServerConfig,
        backend: Backend,
        tokens: TokenTable | None = None,
        on_request: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        if tokens is None and not is_loopback(config.url):
            raise ValueError(
                f"refusing to serve {config.url} without --tokens: an open daemon binds loopback only"
            )
        self.config = config
        self.backend = backend
        self._segments = shm.AttachedSegments(config.max_shm_attached, config.max_shm_segment_bytes)
        self._handler = OpHandler(
            backend=backend,
            limits=config.limits,
            authenticate=tokens.authenticate if tokens else (lambda _t: OPEN_TENANT),
            segments=self._segments if config.shm_enabled and shm.available() else None,
            on_request=on_request,
            access_log_path=config.access_log_path,
        )
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.bound_url: str | None = None
        self.inflight = 0

    @property
    def handler(self) -> OpHandler:
        return self._handler

    def start(self, timeout_s: float = 10.0) -> CacheServer:
        """Run ``serve_forever`` on a daemon thread; returns once bound. Raises RuntimeError."""
        errors: list[BaseException] = []

        def run() -> None:
            try:
                self.serve_forever()
            except BaseException as exc:  # surfaced to the starting thread
                errors.append(exc)
                self._ready.set()

        self._thread = threading.Thread(target=run, name="kvtier-cache-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or errors:
            raise RuntimeError(f"cache server failed to start: {errors[:1]}")
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
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 1000)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its identity
        # ZMQ drops a peer whose frame exceeds this before it is buffered (protects memory);
        # frames up to the limit get a clear TOO_LARGE reply from the handler instead.
        router.setsockopt(zmq.MAXMSGSIZE, 2 * self.config.limits.max_frame_bytes + 4096)
        replies: queue.SimpleQueue[tuple[bytes, Reply]] = queue.SimpleQueue()
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        pool = ThreadPoolExecutor(self.config.num_workers, thread_name_prefix="kvtier-worker")
        try:
            router.bind(self.config.url)
            self.bound_url = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._ready.set()
            self._loop(router, pool, replies, wake_r, wake_w)
        finally:
            pool.shutdown(wait=True)
            self._flush(router, replies)
            router.close(linger=1000)
            ctx.term()
            os.close(wake_r)
            os.close(wake_w)
            self._segments.close()
            self._handler.close()
            self._done.set()

    def _loop(self, router: zmq.Socket, pool: ThreadPoolExecutor,
              replies: queue.SimpleQueue[tuple[bytes, Reply]], wake_r: int, wake_w: int) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake_r, zmq.POLLIN)
        drain_deadline: float | None = None

        def finish(identity: bytes, future: Any) -> None:
            reply = future.result()  # OpHandler.handle never raises
            replies.put((identity, reply))
            os.write(wake_w, b"x")

        while True:
            if self._stop.is_set() and drain_deadline is None:
                drain_deadline = time.monotonic() + self.config.drain_timeout_s
            if drain_deadline is not None and (
                self.inflight == 0 or time.monotonic() > drain_deadline
            ):
                return
            events = dict(poller.poll(50))
            if wake_r in events:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
                self._flush(router, replies)
            if router in events:
                for _ in range(64):  # bounded batch so replies keep flowing under load
                    try:
                        frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    identity = frames[0].bytes
                    if drain_deadline is not None:
                        router.send_multipart(
                            [identity, pack(error_header(-1, ErrorCode.SHUTTING_DOWN,
                                                         "daemon is shutting down"))])
                        continue
                    self.inflight += 1
                    fut = pool.submit(self._handler.handle, frames[1:])
                    fut.add_done_callback(lambda f, ident=identity: finish(ident, f))

    def _flush(self, router: zmq.Socket, replies: queue.SimpleQueue[tuple[bytes, Reply]]) -> None:
        while True:
            try:
                identity, reply = replies.get_nowait()
            except queue.Empty:
                return
            self.inflight -= 1
            try:
                router.send_multipart([identity, pack(reply.header), *reply.payloads], copy=False)
            except zmq.ZMQError:
                pass  # the peer is gone (ROUTER drops silently; this is belt and braces)

