"""Request handling of the cache daemon: one request (frames) in, one ``Reply`` out.

``OpHandler.parse`` authenticates, checks keys and limits and maps client keys into the
tenant's space (``prefix/hex`` is stored as ``tenant/prefix/hex``); ``run`` executes the op
against the daemon's ``HierarchicalStore`` (worker pool); ``serve_inline`` answers a get or
lookup that the host tier can serve whole on the loop thread (``cachestore.server.inline``).
None of them raises: anything malformed is an error reply, a store failure an ``INTERNAL``
reply (a miss to the client).

- get: the keys are pinned in the store while their blocks are copied into the reply (frames,
  or the client's shared-memory segment), so a concurrent put can never overwrite a host-tier
  slot being read. Pool path: ``read_pinned`` (a host block is read only under this request's
  own pin; checksum verified, a corrupt block is a miss). Inline path: a prepared load
  (``prepare_load`` with a host check: stored header and size checked, no second checksum of
  blocks this daemon verified on the way in); a key the host tier lacks, or whose header does
  not match, sends the whole request to the pool path.
- put: every payload must match its size and checksum and be an encoded block
  (``cachestore.codec``) of its key's namespace, or nothing is stored (one pass over each
  payload: ``cachestore.server.puts``). It is acknowledged only after ``put_many`` returned
  having written it, i.e. after the store's write-through tier (LMDB under ``--data-dir``)
  committed it: an acknowledged put survives SIGKILL. Without a write-through tier, a put of
  at most ``INLINE_PUT_BYTES`` whose namespaces the daemon knows runs on the loop thread too.

Replies, records and the access log: ``cachestore.server.records``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import zmq

from cachestore.server.inline import InlineServer
from cachestore.server.leases import ConnLeases
from cachestore.server.puts import PutClaims, put_views, store_put
from cachestore.server.reads import HostReads, copy_out, shm_region
from cachestore.server.records import RequestLog
from cachestore.server.usage import NamespaceUsage
from cachestore.store.hierarchical import HierarchicalStore
from tiers.base import Tier, Value
from tiers.remote import shm
from tiers.remote.protocol import (
    ErrorCode,
    ProtocolError,
    Reply,
    Request,
    RequestRecord,
    ServerLimits,
    Tenant,
    unpack_request,
    zmq_max_frames,
)

_Body = tuple[dict[str, Any], list[Value]]


class OpHandler:
    """Turns one request (frames after the identity) into one ``Reply``; never raises.

    Thread-safe: ``parse``/``serve_inline`` run on the loop thread, ``run`` on the pool.
    ``authenticate`` maps a token to a ``Tenant`` or raises ``ProtocolError``. ``segments`` is
    None when the shared-memory path is off. The handler does not own ``store`` (the daemon's
    owner closes it). ``offer_doorbell(tenant)`` gives the hello-reply fields of the same-host
    doorbell (``cachestore.server.doorbell``), if any; ``offer_stream(tenant)`` those of the
    TCP stream, offered to clients without a segment.
    """

    def __init__(
        self,
        store: HierarchicalStore,
        limits: ServerLimits,
        authenticate: Callable[[object], Tenant],
        segments: shm.AttachedSegments | None,
        usage: NamespaceUsage,
        on_request: Callable[[RequestRecord], None] | None = None,
        access_log_path: str | None = None,
        offer_doorbell: Callable[[str], dict[str, Any]] | None = None,
        offer_stream: Callable[[str], dict[str, Any]] | None = None,
    ) -> None:
        self.store = store
        self.limits = limits
        self.usage = usage
        self.host_id = shm.host_id()
        self._authenticate = authenticate
        self._segments = segments
        self._offer_doorbell = offer_doorbell
        self._offer_stream = offer_stream
        self._log = RequestLog(on_request, access_log_path)
        self._ops: dict[str, Callable[[Request], _Body]] = {
            "hello": self._op_hello,
            "bye": self._op_bye,
            "lookup": self._op_lookup,
            "get": self._op_get,
            "put": self._op_put,
            "delete": self._op_delete,
            "stats": self._op_stats,
        }
        slab = store.host_slab()
        self._fast = HostReads(store, slab) if isinstance(slab, Tier) else None
        self._inline: InlineServer | None = None
        if self._fast is not None:
            # Inline puts only where put_many touches memory alone (no durable write on the loop).
            inline_puts = store.config.write_through_to is None
            self._inline = InlineServer(
                store, self._fast, self._log, self.run, self._shm_region, inline_puts
            )
        self.put_claims = PutClaims()  # keys being put now (races are left out, counted)

    @property
    def num_inline(self) -> int:
        """Requests served on the loop thread (``serve_inline``, ``serve_leased``): a count."""
        return self._inline.num_inline if self._inline is not None else 0

    @property
    def lent_bytes(self) -> int:
        """Host-tier bytes lent to replies in flight (zero-copy sends, ``HostReads.lend``)."""
        return self._fast.lent_bytes if self._fast is not None else 0

    def close(self) -> None:
        self._log.close()

    def handle(self, frames: Sequence[zmq.Frame | bytes]) -> Reply:
        """Parse and run one request (the worker-pool path); never raises."""
        parsed = self.parse(frames)
        return parsed if isinstance(parsed, Reply) else self.run(parsed)

    def parse(self, frames: Sequence[zmq.Frame | bytes]) -> Request | Reply:
        """Decode, authenticate and check one request: a ``Request`` to run, or the error
        ``Reply`` (already recorded). Cheap (no store access): the loop thread calls it."""
        req = self._log.new_request(frames)
        try:
            if len(frames) > zmq_max_frames(self.limits):
                raise ProtocolError(ErrorCode.BAD_FRAME, f"{len(frames)} frames is too many")
            req.header = unpack_request(_buffer(frames[0]), self.limits)
            req.op = req.header["op"]
            who = self._authenticate(req.header.get("token"))
            req.tenant = who.name
            keys: list[str] = req.header.get("keys", [])
            who.check_keys(keys)
            req.rec["num_keys"], req.rec["keys"] = len(keys), keys
            if req.op != "put" and len(frames) > 1:
                raise ProtocolError(ErrorCode.BAD_FRAME, f"{req.op} takes no payload frames")
            req.ikeys = [f"{req.tenant}/{k}" for k in keys]
            return req
        except Exception as exc:
            return self._log.fail(req, exc)

    def run(self, req: Request) -> Reply:
        """Run a parsed request against the store; never raises. For the worker pool."""
        try:
            body, payloads = self._ops[req.op](req)
        except Exception as exc:
            return self._log.fail(req, exc)
        return self._log.ok(req, body, payloads)

    def refuse(self, req: Request, code: ErrorCode, message: str) -> Reply:
        """The recorded error reply to a parsed request (e.g. a doorbell tenant mismatch)."""
        return self._log.fail(req, ProtocolError(code, message))

    def serve_inline(self, req: Request, send: Callable[[Reply], None], lend: bool = False) -> bool:
        """Serve a get or lookup whose keys the host tier holds, or a small put of known
        namespaces into a memory-only store, on the calling (loop) thread, and ``send`` its
        reply while the blocks are still pinned; False (nothing sent, nothing pinned) when the
        request needs the worker pool (``cachestore.server.inline``). ``lend`` False: ``send``
        must copy payload frames (the blocks are unpinned when it returns). ``lend`` True:
        ``send`` may keep them (ZMQ zero copy); each payload view's block stays pinned until
        the last reference to the view is gone (``HostReads.lend``), so ``send`` must not keep
        views beyond the transfer."""
        return self._inline is not None and self._inline.serve(req, send, lend)

    def serve_leased(self, req: Request, send: Callable[[Reply], None], leases: ConnLeases) -> bool:
        """Answer get ``req`` with where its host blocks lie in the slab, each pinned under
        ``leases`` until that is released (``cachestore.server.leases``); False (nothing sent or
        pinned) when it must take the copy path (a miss, a foreign header, a cap reached)."""
        return self._inline is not None and self._inline.serve_leased(req, send, leases)

    # -- ops: each returns (reply fields, payload frames) ------------------------------------

    def _op_hello(self, req: Request) -> _Body:
        header, tenant = req.header, req.tenant
        replaced = header.get("replaces")
        if isinstance(replaced, str) and self._segments is not None:
            self._segments.detach(replaced, tenant)  # the client grew its segment
        shm_ok = self._attach(header, tenant)
        lim = self.limits
        body: dict[str, Any] = {
            "shm": shm_ok,
            "namespace": tenant,
            "max_keys_per_request": lim.max_keys_per_request,
            "max_frame_bytes": lim.max_frame_bytes,
            "max_request_bytes": lim.max_request_bytes,
        }
        if shm_ok and header.get("doorbell") is True and self._offer_doorbell is not None:
            body.update(self._offer_doorbell(tenant))  # same host proven by the mapping
        elif not shm_ok and header.get("stream") is True and self._offer_stream is not None:
            body.update(self._offer_stream(tenant))  # payload frames over a TCP connection
        return body, []

    def _attach(self, header: dict[str, Any], tenant: str) -> bool:
        """Attach the shared-memory segment a hello names, if it is on this host."""
        name = header.get("shm")
        if not (
            isinstance(name, str)
            and self._segments is not None
            and header.get("host_id") == self.host_id
        ):
            return False
        try:
            self._segments.attach(name, tenant)
            return True
        except (OSError, ValueError):
            return False  # another /dev/shm (container) or a bad name: frames it is

    def _op_bye(self, req: Request) -> _Body:
        name = req.header.get("shm")
        if isinstance(name, str) and self._segments is not None:
            self._segments.detach(name, req.tenant)
        return {}, []

    def _op_lookup(self, req: Request) -> _Body:
        count = self.store.lookup(req.ikeys).num_blocks if req.ikeys else 0
        req.rec["num_hits"] = count
        return {"count": count}, []

    def _op_get(self, req: Request) -> _Body:
        segment, offset, end = self._shm_region(req.header, req.tenant)
        if not req.ikeys:
            return {"sizes": [], **({"shm_offsets": []} if segment is not None else {})}, []
        # Host-tier views are read only under this request's own pins (never a block a
        # concurrent put may evict, or whose pin another request may drop).
        with self.store.read_pinned(req.ikeys) as values:
            if self._fast is not None:
                self._fast.learn(req.tenant, req.header["keys"], values)
            # The reply leaves from the loop thread after the unpin: frames own their bytes.
            return copy_out(values, segment, offset, end, req.rec, owned=True)

    def _op_put(self, req: Request) -> _Body:
        header, rec = req.header, req.rec
        sizes: list[int] = header["sizes"]
        views = put_views(
            header,
            sizes,
            [_buffer(f) for f in req.frames[1:]],
            self.limits,
            lambda: self._shm_region(header, req.tenant)[0],
            rec,
        )
        rec["num_raced"] = len(set(req.ikeys))  # until store_put says otherwise (PUT_RACED: all)
        stored, rec["num_raced"] = store_put(
            self.store,
            self.usage,
            self.limits.max_namespace_bytes,
            self._fast,
            header,
            req.tenant,
            req.ikeys,
            views,
            self.put_claims,
        )
        rec["bytes_in"] = sum(sizes)
        return {"stored": stored, "raced": rec["num_raced"], "evicted": 0}, []

    def _op_delete(self, req: Request) -> _Body:
        deleted = self.store.delete_many(req.ikeys) if req.ikeys else 0
        self.usage.remove(req.ikeys)
        return {"deleted": deleted}, []

    def _op_stats(self, req: Request) -> _Body:
        mine = self.usage.snapshot().get(req.tenant, {"bytes": 0, "keys": 0})
        return {"stats": {"namespace": req.tenant, **mine}}, []

    def _shm_region(
        self, header: dict[str, Any], tenant: str
    ) -> tuple[shm.ShmSegment | None, int, int]:
        return shm_region(self._segments, header, tenant)


def _buffer(frame: zmq.Frame | bytes) -> memoryview:
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
