"""The ``remote`` tier: a client of ``kvtier cache-server`` (wire format: cachestore.server_protocol).

Config: ``{kind: remote, url: "tcp://host:port", token: ... | token_file: PATH,
timeout_s: ... | timeout_ms: ...}`` (``cachestore.tier_config.RemoteTierConfig``).

- Connections: one DEALER socket per calling thread (ZMQ sockets are not thread-safe), created
  lazily, reused across calls, replaced after any timeout (a fresh socket drops stale replies).
- Pipelining: a batch is cut into requests of at most ``batch_keys`` keys that are all sent
  before the first reply is read; replies are matched by request id and may come back in any
  order. A reply with an unknown id (a request that already timed out) is dropped.
- Failures: a server that is down, slow or answering with an error raises ``TierError`` within
  ``timeout_s`` (never a hang); for ``retry_interval_s`` afterwards the thread fails fast
  without waiting, then tries again (ZMQ reconnects underneath). The store makes it a miss.
- Same host: the first request of a thread sends a ``hello`` naming a fresh shared-memory
  segment (``cachestore.shm``); if the daemon maps it, payloads move through it and only
  headers cross the socket. Otherwise, or whenever the daemon forgets the segment, frames.
- ``get_many`` values are memoryviews (of a received frame or of this thread's segment) valid
  until the next call on the same thread, as tiers/base.py allows.

Thread-safe (per-thread connections). ``close`` must not race with calls in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

from cachestore import shm
from cachestore.server_protocol import PROTOCOL_VERSION, ErrorCode, checksum, pack
from tiers.base import Evicted, Tier, TierError, TierUsage, Value

if TYPE_CHECKING:
    from cachestore.tier_config import RemoteTierConfig


class _ShmLost(TierError):
    """The daemon no longer maps this thread's segment (it restarted): hello, then retry."""


class _Conn:
    """One thread's socket, segment and negotiated limits."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.next_id = 1
        self.hello_done = False
        self.segment: shm.ShmSegment | None = None
        self.max_keys = 1024
        self.max_request_bytes = 1 << 30


class RemoteTier(Tier):
    name = "remote"

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 5.0,
                 batch_keys: int = 64, use_shm: bool = True, shm_bytes: int = 64 << 20,
                 max_shm_bytes: int = 1 << 30, retry_interval_s: float = 0.5) -> None:
        if not url.startswith(("tcp://", "ipc://")):
            raise ValueError(f"remote tier url must be tcp://HOST:PORT or ipc://PATH, got {url!r}")
        self.url = url
        self._token = token or ""
        self.timeout_s = timeout_s
        self.batch_keys = batch_keys
        self.use_shm = use_shm and shm.available()
        self.shm_bytes = shm_bytes
        self.max_shm_bytes = max_shm_bytes
        self.retry_interval_s = retry_interval_s
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._conns: list[_Conn] = []
        self._host_id = shm.host_id()
        self._closed = False

    @classmethod
    def from_config(cls, config: RemoteTierConfig) -> RemoteTier:
        """From ``cachestore.tier_config.RemoteTierConfig``: ``token_file`` is read here (its
        contents, surrounding whitespace stripped). Raises TierError if it cannot be read or
        is empty."""
        token = config.token
        if config.token_file is not None:
            try:
                token = Path(config.token_file).read_text().strip()
            except OSError as exc:
                raise TierError(f"remote tier: cannot read token_file: {exc}") from None
            if not token:
                raise TierError(f"remote tier: token_file {config.token_file} is empty")
        return cls(config.url, token=token, timeout_s=config.effective_timeout_s)

    def __repr__(self) -> str:  # never print the token
        return f"RemoteTier(url={self.url!r}, token={'***' if self._token else None})"

    # -- Tier API ------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> int:
        count = 0
        for chunk, reply in self._batched("lookup", keys):
            count += reply["count"]
            if reply["count"] < len(chunk):
                break  # leading keys only: later chunks do not count past a gap
        return count

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        try:
            return self._get_many(keys)
        except _ShmLost:
            return self._get_many(keys)  # once more, after a fresh hello

    def put_many(self, items: Sequence[tuple[str, Value]]) -> list[Evicted]:
        try:
            return self._put_many(items)
        except _ShmLost:
            return self._put_many(items)

    def _get_many(self, keys: Sequence[str]) -> list[Value | None]:
        conn = self._conn()
        out: list[Value | None] = []
        chunks = _chunks(list(keys), min(self.batch_keys, conn.max_keys))
        requests = []
        region = conn.segment.size // max(len(chunks), 1) if conn.segment is not None else 0
        for i, chunk in enumerate(chunks):
            header: dict[str, Any] = {"op": "get", "keys": chunk}
            if conn.segment is not None:
                header.update(shm=conn.segment.name, shm_start=i * region, shm_length=region)
            requests.append((header, []))
        needed = 0
        for header, payloads in self._call(conn, requests):
            offsets = header.get("shm_offsets")
            frame_iter = iter(payloads)
            for j, size in enumerate(header["sizes"]):
                if size < 0:
                    out.append(None)
                elif offsets is not None and offsets[j] >= 0 and conn.segment is not None:
                    out.append(conn.segment.buf[offsets[j] : offsets[j] + size])
                else:
                    out.append(next(frame_iter).buffer)
                needed += max(size, 0)
        if conn.segment is not None and needed > conn.segment.size:
            self._grow(conn, needed)  # the next batch of this size fits in shared memory
        return out

    def _put_many(self, items: Sequence[tuple[str, Value]]) -> list[Evicted]:
        conn = self._conn()
        total = sum(len(v) for _, v in items)
        if conn.segment is not None and total > conn.segment.size:
            self._grow(conn, total)
        requests = []
        offset = 0
        for chunk in _chunks(list(items), min(self.batch_keys, conn.max_keys)):
            header: dict[str, Any] = {
                "op": "put", "keys": [k for k, _ in chunk], "sizes": [len(v) for _, v in chunk],
                "checksums": [checksum(v) for _, v in chunk],
            }
            payloads: list[Value] = [v for _, v in chunk]
            seg = conn.segment
            if seg is not None and offset + sum(header["sizes"]) <= seg.size:
                offsets = []
                for _, v in chunk:
                    seg.buf[offset : offset + len(v)] = v
                    offsets.append(offset)
                    offset += len(v)
                header.update(shm=seg.name, shm_offsets=offsets)
                payloads = []
            requests.append((header, payloads))
        for _ in self._call(conn, requests):
            pass
        # The daemon keeps evicted blocks in its own lower tiers: nothing to hand back here.
        return []

    def delete_many(self, keys: Sequence[str]) -> int:
        return sum(reply["deleted"] for _, reply in self._batched("delete", keys))

    def usage(self) -> TierUsage:
        conn = self._conn()
        ((header, _),) = self._call(conn, [({"op": "stats"}, [])])
        stats = header["stats"]
        return TierUsage(used_bytes=stats["bytes"], capacity_bytes=None, num_entries=stats["keys"])

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns, self._conns = self._conns, []
        for conn in conns:
            if conn.segment is not None:
                try:  # let the daemon drop its mapping now rather than at LRU time
                    msg = {"v": PROTOCOL_VERSION, "id": 0, "op": "bye", "token": self._token,
                           "shm": conn.segment.name}
                    conn.sock.send(pack(msg), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                conn.segment.close()
            conn.sock.close(linger=100)
        self._ctx.term()

    # -- plumbing ------------------------------------------------------------------------------

    def _batched(self, op: str, keys: Sequence[str]) -> list[tuple[list[str], dict[str, Any]]]:
        conn = self._conn()
        chunks = _chunks(list(keys), min(self.batch_keys, conn.max_keys))
        replies = self._call(conn, [({"op": op, "keys": c}, []) for c in chunks])
        return [(c, h) for c, (h, _) in zip(chunks, replies, strict=True)]

    def _conn(self) -> _Conn:
        if self._closed:
            raise TierError("remote tier is closed")
        conn: _Conn | None = getattr(self._local, "conn", None)
        if conn is None:
            if time.monotonic() < getattr(self._local, "down_until", 0.0):
                raise TierError(f"cache server {self.url} unavailable (retrying shortly)")
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue requests for a server not there
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            sock.connect(self.url)
            conn = _Conn(sock)
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        if not conn.hello_done:
            self._hello(conn)
        return conn

    def _hello(self, conn: _Conn, size: int | None = None) -> None:
        segment = None
        if self.use_shm:
            try:
                segment = shm.ShmSegment.create(size or self.shm_bytes)
            except OSError:
                segment = None
        header: dict[str, Any] = {"op": "hello", "host_id": self._host_id}
        if segment is not None:
            header["shm"] = segment.name
        if conn.segment is not None:
            header["replaces"] = conn.segment.name  # the daemon unmaps the old one now
        conn.hello_done = True  # _call below must not recurse into another hello
        try:
            ((reply, _),) = self._call(conn, [(header, [])])
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

    def _grow(self, conn: _Conn, needed: int) -> None:
        size = min(max(needed, 2 * (conn.segment.size if conn.segment else 0)), self.max_shm_bytes)
        if conn.segment is not None and size > conn.segment.size:
            self._hello(conn, size)

    def _call(self, conn: _Conn, requests: list[tuple[dict[str, Any], list[Value]]]
              ) -> list[tuple[dict[str, Any], list[zmq.Frame]]]:
        """Send every request, then collect every reply (pipelined). Raises TierError."""
        deadline = time.monotonic() + self.timeout_s
        ids: list[int] = []
        try:
            for header, payloads in requests:
                request_id = conn.next_id
                conn.next_id += 1
                ids.append(request_id)
                msg = {"v": PROTOCOL_VERSION, "id": request_id, "token": self._token, **header}
                if not conn.sock.poll(_ms_left(deadline), zmq.POLLOUT):
                    raise TierError(f"cache server {self.url} not reachable")
                conn.sock.send_multipart([pack(msg), *payloads], copy=False)
            replies: dict[int, tuple[dict[str, Any], list[zmq.Frame]]] = {}
            while len(replies) < len(ids):
                if not conn.sock.poll(_ms_left(deadline), zmq.POLLIN):
                    raise TierError(f"cache server {self.url} timed out after {self.timeout_s}s")
                frames = conn.sock.recv_multipart(copy=False)
                reply = msgpack.unpackb(frames[0].buffer, raw=False)
                if reply.get("id") in ids:
                    replies[reply["id"]] = (reply, frames[1:])
                elif reply.get("id") == -1:  # an error the daemon could not tie to an id
                    raise TierError(f"cache server refused a request: {reply.get('error')}")
        except TierError:
            self._reset(conn)
            raise
        except zmq.ZMQError as exc:
            self._reset(conn)
            raise TierError(f"cache server {self.url}: {exc}") from exc
        out = [replies[i] for i in ids]
        for reply, _ in out:
            code = reply.get("code", ErrorCode.INTERNAL)
            if code == ErrorCode.SHM_UNAVAILABLE:
                conn.hello_done = False  # the daemon restarted or forgot us: hello again next call
                raise _ShmLost("cache server lost the shared-memory segment")
            if code != ErrorCode.OK:
                raise TierError(f"cache server error {ErrorCode(code).name}: {reply.get('error')}")
        return out

    def _reset(self, conn: _Conn) -> None:
        """Drop a socket that timed out; fail fast for ``retry_interval_s``."""
        with self._lock:
            if conn in self._conns:
                self._conns.remove(conn)
        if conn.segment is not None:
            conn.segment.close()
        conn.sock.close(linger=0)
        self._local.conn = None
        self._local.down_until = time.monotonic() + self.retry_interval_s


def _ms_left(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000))


def _chunks(seq: list[Any], size: int) -> list[list[Any]]:
    return [seq[i : i + size] for i in range(0, len(seq), max(size, 1))]
