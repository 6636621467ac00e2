"""The ``remote`` tier: a client of ``kvtier cache-server`` (wire format: tiers.remote.protocol).

Config: ``{kind: remote, url: "tcp://host:port", token: ... | token_file: PATH,
timeout_s: ... | timeout_ms: ...}`` (``tiers.config.RemoteTierConfig``).

- Connections (``tiers.remote.conn``): one DEALER socket per calling thread (ZMQ sockets are
  not thread-safe), created lazily, reused across calls, replaced after any timeout.
- Pipelining: a batch is cut into requests of at most ``batch_keys`` keys that are all sent
  before the first reply is read; replies are matched by request id and may come back in any
  order. A reply with an unknown id (a request that already timed out) is dropped.
- Failures: a server that is down, slow or answering with an error raises ``TierError`` within
  ``timeout_s`` (never a hang); for ``retry_interval_s`` afterwards the thread fails fast
  without waiting, then tries again (ZMQ reconnects underneath). The store makes it a miss.
- Same host: the first request of a thread sends a ``hello`` naming a fresh shared-memory
  segment (``tiers.remote.shm``); if the daemon maps it, payloads move through it and only
  headers cross the socket. Otherwise, or whenever the daemon forgets the segment, frames.
  With ``use_doorbell`` (default) those headers go over the daemon's same-host Unix socket
  (``cachestore.server.doorbell``) instead of ZMQ when the hello offers one; ZMQ stays the fallback.
- Without a segment (another host, or shm off) and with ``use_stream`` (default), requests and
  payload frames go over the daemon's TCP stream (``cachestore.server.doorbell``, ``tcp``: a plain
  socket served by one daemon thread) when the hello offers one; ZMQ stays the fallback.
- Waiting for a reply (doorbell or stream, or ZMQ to a loopback/ipc url), the thread polls for
  ``spin_us`` before it blocks (a wake-up costs more than a short single-key request on a
  small VM); 0: block at once. Replies from another machine are waited for blocking, and so
  are ZMQ replies behind a large message (``tiers.remote.conn.SPIN_MAX_BYTES``).
- Zero-copy same host (``use_leases``, ``cachestore.server.leases``): when the daemon's host slab
  holds one namespace, the doorbell hands it over (read-only) and a get of host hits returns
  views of it, the blocks leased (pinned) until this thread's next call or ``close``.
- ``get_many`` values are memoryviews (of a received frame, of this thread's segment or,
  read-only, of the daemon's slab) valid until the next call on the same thread, as
  tiers/base.py allows.

Thread-safe (per-thread connections). ``close`` must not race with calls in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiers.base import Evicted, Tier, TierError, TierUsage, Value
from tiers.remote import shm
from tiers.remote.conn import Connections, ShmLost
from tiers.remote.protocol import checksum

if TYPE_CHECKING:
    from tiers.config import RemoteTierConfig


class RemoteTier(Tier):
    name = "remote"

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout_s: float = 5.0,
        batch_keys: int = 64,
        use_shm: bool = True,
        shm_bytes: int = 64 << 20,
        max_shm_bytes: int = 1 << 30,
        retry_interval_s: float = 0.5,
        use_doorbell: bool = True,
        spin_us: float = 250.0,
        use_leases: bool = True,
        use_stream: bool = True,
    ) -> None:
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
        self.use_doorbell = use_doorbell
        # Values handed out as views of the daemon's slab (leased), all threads; unlocked
        # (may undercount under concurrent calls): tests and diagnostics.
        self.num_in_place = 0
        self._net = Connections(
            url,
            self._token,
            timeout_s,
            self.use_shm,
            shm_bytes,
            max_shm_bytes,
            retry_interval_s,
            use_doorbell,
            spin_us * 1e-6,
            use_leases,
            use_stream,
        )

    @classmethod
    def from_config(cls, config: RemoteTierConfig) -> RemoteTier:
        """From ``tiers.config.RemoteTierConfig``: ``token_file`` is read here (its
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

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """One single-key lookup request per key, pipelined in one call per chunk."""
        if not keys:
            return []
        conn = self._net.get()
        out: list[bool] = []
        for chunk in _chunks(list(keys), min(self.batch_keys, conn.max_keys)):
            replies = self._net.call(conn, [({"op": "lookup", "keys": [k]}, []) for k in chunk])
            out.extend(bool(header["count"]) for header, _ in replies)
        return out

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        try:
            return self._get_many(keys)
        except ShmLost:
            return self._get_many(keys)  # once more, after a fresh hello

    def put_many(self, items: Sequence[tuple[str, Value]]) -> list[Evicted]:
        try:
            return self._put_many(items)
        except ShmLost:
            return self._put_many(items)

    def _get_many(self, keys: Sequence[str]) -> list[Value | None]:
        conn = self._net.get()
        out: list[Value | None] = []
        chunks = _chunks(list(keys), min(self.batch_keys, conn.max_keys))
        requests: list[tuple[dict[str, Any], list[Value]]] = []
        region = conn.segment.size // max(len(chunks), 1) if conn.segment is not None else 0
        for i, chunk in enumerate(chunks):
            header: dict[str, Any] = {"op": "get", "keys": chunk}
            if conn.segment is not None:
                header.update(shm=conn.segment.name, shm_start=i * region, shm_length=region)
            requests.append((header, []))
        needed = 0
        for header, payloads in self._net.call(conn, requests):
            in_slab = header.get("slab_offsets")
            if in_slab is not None:  # leased: the daemon's slab, read in place
                slab = conn.bell.slab if conn.bell is not None else None
                if slab is None or any(
                    o < 0 or o + n > len(slab)
                    for o, n in zip(in_slab, header["sizes"], strict=True)
                ):
                    raise TierError("cache server answered slab offsets outside its slab")
                out.extend(slab[o : o + n] for o, n in zip(in_slab, header["sizes"], strict=True))
                self.num_in_place += len(in_slab)
                continue
            offsets = header.get("shm_offsets")
            frame_iter = iter(payloads)
            for j, size in enumerate(header["sizes"]):
                if size < 0:
                    out.append(None)
                elif offsets is not None and offsets[j] >= 0 and conn.segment is not None:
                    out.append(conn.segment.buf[offsets[j] : offsets[j] + size])
                else:
                    out.append(next(frame_iter))
                needed += max(size, 0)
        if conn.segment is not None and needed > conn.segment.size:
            self._net.grow(conn, needed)  # the next batch of this size fits in shared memory
        return out

    def _put_many(self, items: Sequence[tuple[str, Value]]) -> list[Evicted]:
        conn = self._net.get()
        total = sum(len(v) for _, v in items)
        if conn.segment is not None and total > conn.segment.size:
            self._net.grow(conn, total)
        requests = []
        offset = 0
        for chunk in _chunks(list(items), min(self.batch_keys, conn.max_keys)):
            header: dict[str, Any] = {
                "op": "put",
                "keys": [k for k, _ in chunk],
                "sizes": [len(v) for _, v in chunk],
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
        for _ in self._net.call(conn, requests):
            pass
        # The daemon keeps evicted blocks in its own lower tiers: nothing to hand back here.
        return []

    def delete_many(self, keys: Sequence[str]) -> int:
        return sum(reply["deleted"] for _, reply in self._batched("delete", keys))

    def ping(self) -> None:
        """The daemon's ``stats`` op: a header-only round trip."""
        conn = self._net.get()
        self._net.call(conn, [({"op": "stats"}, [])])

    def usage(self) -> TierUsage:
        conn = self._net.get()
        ((header, _),) = self._net.call(conn, [({"op": "stats"}, [])])
        stats = header["stats"]
        return TierUsage(used_bytes=stats["bytes"], capacity_bytes=None, num_entries=stats["keys"])

    def transport(self) -> str:
        """This thread's transport: "doorbell", "stream", "zmq" or "none" (not connected yet); with
        "+slab" when its doorbell maps the daemon's host slab (gets may be read in place)."""
        return self._net.transport()

    def close(self) -> None:
        """Close every thread's connection. Idempotent; later calls raise TierError."""
        self._net.close()

    # -- plumbing ------------------------------------------------------------------------------

    def _batched(self, op: str, keys: Sequence[str]) -> list[tuple[list[str], dict[str, Any]]]:
        conn = self._net.get()
        chunks = _chunks(list(keys), min(self.batch_keys, conn.max_keys))
        replies = self._net.call(conn, [({"op": op, "keys": c}, []) for c in chunks])
        return [(c, h) for c, (h, _) in zip(chunks, replies, strict=True)]


def _chunks(seq: list[Any], size: int) -> list[list[Any]]:
    return [seq[i : i + size] for i in range(0, len(seq), max(size, 1))]
