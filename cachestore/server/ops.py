"""Request handling of the cache daemon: one request (frames) in, one ``Reply`` out.

``OpHandler.parse`` authenticates, checks keys and limits and maps client keys into the
tenant's space (``prefix/hex`` is stored as ``tenant/prefix/hex``); ``run`` executes the op
against the daemon's ``HierarchicalStore`` (worker pool); ``serve_inline`` answers a get or
lookup that the host tier can serve whole on the loop thread (``cachestore.server.reads``).
None of them raises: anything malformed is an error reply, a store failure an ``INTERNAL``
reply (a miss to the client).

- get: the keys are pinned in the store while their blocks are copied into the reply (frames,
  or the client's shared-memory segment), so a concurrent put can never overwrite a host-tier
  slot being read. Pool path: ``get_many_pinned`` (a host block is read only under this
  request's own pin; checksum verified, a corrupt block is a miss). Inline path: ``locate_host`` (stored header and size checked, no
  second checksum of blocks this daemon verified on the way in); a key the host tier lacks,
  or whose header does not match, sends the whole request to the pool path.
- put: every payload must match its size and checksum and be an encoded block
  (``cachestore.codec``) of its key's namespace, or nothing is stored (one pass over each
  payload: ``cachestore.server.puts``). It is acknowledged only after ``put_many`` returned
  having written it, i.e. after the store's write-through tier (LMDB under ``--data-dir``)
  committed it: an acknowledged put survives SIGKILL. Without a write-through tier, a put of
  at most ``INLINE_PUT_BYTES`` whose namespaces the daemon knows runs on the loop thread too.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from cachestore.server.leases import ConnLeases
from cachestore.server.puts import PutClaims, put_views, store_put
from cachestore.server.reads import HostReads, copy_out, shm_region
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
    error_header,
    unpack_request,
    zmq_max_frames,
)

_Body = tuple[dict[str, Any], list[Value]]
_Op = Callable[[dict[str, Any], str, list[str], Sequence[Any], dict[str, Any]], _Body]
_LOGGED_OPS = frozenset({"lookup", "get", "put", "delete"})
# A put this small runs on the loop thread (one checksum pass and one copy, ~70 us per 2 MiB)
# rather than paying the pool hand-off; larger ones would hold up other clients' requests.
INLINE_PUT_BYTES = 8 << 20


class OpHandler:
    """Turns one request (frames after the identity) into one ``Reply``; never raises.

    Thread-safe: ``parse``/``serve_inline`` run on the loop thread, ``run`` on the pool. ``authenticate`` maps a token to a ``Tenant`` or
    raises ``ProtocolError``. ``segments`` is None when the shared-memory path is off. The
    handler does not own ``store`` (the daemon's owner closes it). ``offer_doorbell(tenant)``
    gives the hello-reply fields of the same-host doorbell (``cachestore.server.doorbell``), if any;
    ``offer_stream(tenant)`` those of the TCP stream, offered to clients without a segment.
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
        self._on_request = on_request
        self._offer_doorbell = offer_doorbell
        self._offer_stream = offer_stream
        self._log_lock = threading.Lock()
        self._log = open(access_log_path, "a", buffering=1) if access_log_path else None
        self._ops: dict[str, _Op] = {
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
        # Inline puts only where put_many touches memory alone (no durable write on the loop).
        self._inline_puts = self._fast is not None and store.config.write_through_to is None
        self.num_inline = 0  # requests served by serve_inline (a count, for tests and metrics)
        self.put_claims = PutClaims()  # keys being put now (races are left out, counted)

    @property
    def lent_bytes(self) -> int:
        """Host-tier bytes lent to replies in flight (zero-copy sends, ``HostReads.lend``)."""
        return self._fast.lent_bytes if self._fast is not None else 0

    def close(self) -> None:
        if self._log is not None:
            with self._log_lock:
                self._log.close()
                self._log = None

    def handle(self, frames: Sequence[zmq.Frame | bytes]) -> Reply:
        """Parse and run one request (the worker-pool path); never raises."""
        parsed = self.parse(frames)
        return parsed if isinstance(parsed, Reply) else self.run(parsed)

    def parse(self, frames: Sequence[zmq.Frame | bytes]) -> Request | Reply:
        """Decode, authenticate and check one request: a ``Request`` to run, or the error
        ``Reply`` (already recorded). Cheap (no store access): the loop thread calls it."""
        req = Request(
            {},
            "?",
            "?",
            [],
            frames,
            {
                "num_keys": 0,
                "num_hits": 0,
                "bytes_in": 0,
                "bytes_out": 0,
                "path": "tcp",
                "keys": [],
            },
            time.perf_counter(),
        )
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
            return self._fail(req, exc)

    def run(self, req: Request) -> Reply:
        """Run a parsed request against the store; never raises. For the worker pool."""
        try:
            body, payloads = self._ops[req.op](
                req.header, req.tenant, req.ikeys, req.frames[1:], req.rec
            )
        except Exception as exc:
            return self._fail(req, exc)
        return self._done(req, ErrorCode.OK, self._ok(req, body, payloads))

    def refuse(self, req: Request, code: ErrorCode, message: str) -> Reply:
        """The recorded error reply to a parsed request (e.g. a doorbell tenant mismatch)."""
        return self._fail(req, ProtocolError(code, message))

    def serve_inline(self, req: Request, send: Callable[[Reply], None], lend: bool = False) -> bool:
        """Serve a get or lookup whose keys the host tier holds, or a small put of known
        namespaces into a memory-only store, on the calling (loop) thread, and ``send`` its
        reply while the blocks are still pinned; False (nothing sent, nothing pinned) when the
        request needs the worker pool. ``lend`` False: ``send`` must copy payload frames (the
        blocks are unpinned when it returns). ``lend`` True: ``send`` may keep them (ZMQ zero
        copy); each payload view's block stays pinned until the last reference to the view
        is gone (``HostReads.lend``), so ``send`` must not keep views beyond the transfer.
        Host blocks skip the checksum (this daemon checked it on the way in: a put payload,
        or a lower-tier read before promotion) but not ``locate_host``'s header and size check."""
        if self._fast is None or not req.ikeys:
            return False
        if req.op == "put":
            if (
                not self._inline_puts
                or sum(req.header["sizes"]) > INLINE_PUT_BYTES
                or any(
                    self._fast.hint(req.tenant, k.split("/", 1)[0]) is None
                    for k in req.header["keys"]
                )
            ):
                return False
            self.num_inline += 1
            send(self.run(req))
            return True
        if req.op not in ("get", "lookup"):
            return False
        if req.op == "lookup":
            if self._fast.lookup(req.ikeys) < len(req.ikeys):
                return False
            req.rec["num_hits"] = len(req.ikeys)
            # Counted before the reply leaves: a client that saw the reply sees the count.
            self.num_inline += 1
            send(self._done(req, ErrorCode.OK, self._ok(req, {"count": len(req.ikeys)}, [])))
            return True
        try:
            segment, offset, end = self._shm_region(req.header, req.tenant)
        except ProtocolError:
            return False  # the pool answers it with the error
        views = self._fast.pinned_views(req.tenant, req.header["keys"], req.ikeys)
        if views is None:
            return False
        try:
            body, payloads = copy_out(views, segment, offset, end, req.rec, owned=False)
        except Exception:  # e.g. the segment was detached meanwhile: the pool decides
            self.store.unpin_host(req.ikeys)
            req.rec.update(num_hits=0, bytes_out=0, path="tcp")
            return False
        self.num_inline += 1  # before the reply leaves (see the lookup case)
        lent = self._fast.lend(req.ikeys, views, payloads) if lend else [False] * len(views)
        reply = self._ok(req, body, payloads)
        del views, payloads  # a lent block's pin goes with the last reference to its view
        try:
            send(self._done(req, ErrorCode.OK, reply))
            del reply
        finally:
            self.store.unpin_host(
                [k for k, was_lent in zip(req.ikeys, lent, strict=True) if not was_lent]
            )
        return True

    def serve_leased(self, req: Request, send: Callable[[Reply], None], leases: ConnLeases) -> bool:
        """Answer get ``req`` with where its host blocks lie in the slab, each pinned under
        ``leases`` until that is released (``cachestore.server.leases``); False (nothing sent or
        pinned) when it must take the copy path (a miss, a foreign header, a cap reached)."""
        body = (
            leases.grant(self._fast, req)
            if (self._fast is not None and req.op == "get" and req.ikeys)
            else None
        )
        if body is None:
            return False
        self.num_inline += 1
        send(self._done(req, ErrorCode.OK, self._ok(req, body, [])))
        return True

    def _ok(self, req: Request, body: dict[str, Any], payloads: list[Value]) -> Reply:
        return Reply({"id": req.header["id"], "code": 0, "error": "", **body}, payloads)

    def _fail(self, req: Request, exc: Exception) -> Reply:
        request_id = req.header.get("id", -1)
        if isinstance(exc, ProtocolError):
            return self._done(
                req, exc.code, Reply(error_header(request_id, exc.code, exc.message), [])
            )
        # A store failure: the client sees a miss, the daemon lives.
        message = f"store error: {exc!r}"[:500]
        return self._done(
            req,
            ErrorCode.INTERNAL,
            Reply(error_header(request_id, ErrorCode.INTERNAL, message), []),
        )

    def _done(self, req: Request, code: ErrorCode, reply: Reply) -> Reply:
        """Record and log a finished request; returns ``reply``."""
        rec = req.rec
        if self._on_request is not None:
            self._on_request(
                RequestRecord(
                    req.op,
                    req.tenant,
                    code,
                    rec["num_keys"],
                    rec["num_hits"],
                    rec["bytes_in"],
                    rec["bytes_out"],
                    rec["path"],
                    time.perf_counter() - req.start,
                    rec.get("num_raced", 0) if code in (ErrorCode.OK, ErrorCode.PUT_RACED) else 0,
                )
            )
        if self._log is not None and code == ErrorCode.OK and req.op in _LOGGED_OPS:
            line = json.dumps(
                {
                    "ts": round(time.time(), 6),
                    "op": req.op,
                    "namespace": req.tenant,
                    "keys": rec["keys"],
                    "hits": rec["num_hits"],
                }
            )
            with self._log_lock:
                if self._log is not None:
                    self._log.write(line + "\n")
        return reply

    # -- ops: each returns (reply fields, payload frames) ------------------------------------

    def _op_hello(
        self,
        header: dict[str, Any],
        tenant: str,
        ikeys: list[str],
        frames: Sequence[Any],
        rec: dict[str, Any],
    ) -> _Body:
        shm_ok = False
        replaced = header.get("replaces")
        if isinstance(replaced, str) and self._segments is not None:
            self._segments.detach(replaced, tenant)  # the client grew its segment
        name = header.get("shm")
        if (
            isinstance(name, str)
            and self._segments is not None
            and header.get("host_id") == self.host_id
        ):
            try:
                self._segments.attach(name, tenant)
                shm_ok = True
            except (OSError, ValueError):
                shm_ok = False  # another /dev/shm (container) or a bad name: frames it is
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

    def _op_bye(
        self,
        header: dict[str, Any],
        tenant: str,
        ikeys: list[str],
        frames: Sequence[Any],
        rec: dict[str, Any],
    ) -> _Body:
        name = header.get("shm")
        if isinstance(name, str) and self._segments is not None:
            self._segments.detach(name, tenant)
        return {}, []

    def _op_lookup(
        self,
        header: dict[str, Any],
        tenant: str,
        ikeys: list[str],
        frames: Sequence[Any],
        rec: dict[str, Any],
    ) -> _Body:
        count = self.store.lookup(ikeys).num_blocks if ikeys else 0
        rec["num_hits"] = count
        return {"count": count}, []

    def _op_get(
        self,
        header: dict[str, Any],
        tenant: str,
        ikeys: list[str],
        frames: Sequence[Any],
        rec: dict[str, Any],
    ) -> _Body:
        segment, offset, end = self._shm_region(header, tenant)
        if not ikeys:
            return {"sizes": [], **({"shm_offsets": []} if segment is not None else {})}, []
        # Host-tier views are read only under this request's own pins (never a block a
        # concurrent put may evict, or whose pin another request may drop).
        values, pinned = self.store.get_many_pinned(ikeys)
        try:
            if self._fast is not None:
                self._fast.learn(tenant, header["keys"], values)
            # The reply leaves from the loop thread after the unpin: frames own their bytes.
            return copy_out(values, segment, offset, end, rec, owned=True)
        finally:
            self.store.unpin_host(pinned)

    def _op_put(
        self,
        header: dict[str, Any],
        tenant: str,
        ikeys: list[str],
        frames: Sequence[Any],
        rec: dict[str, Any],
    ) -> _Body:
        sizes: list[int] = header["sizes"]
        views = put_views(
            header,
            sizes,
            [_buffer(f) for f in frames],
            self.limits,
            lambda: self._shm_region(header, tenant)[0],
            rec,
        )
        rec["num_raced"] = len(set(ikeys))  # until store_put says otherwise (PUT_RACED: all)
        stored, rec["num_raced"] = store_put(
            self.store,
            self.usage,
            self.limits.max_namespace_bytes,
            self._fast,
            header,
            tenant,
            ikeys,
            views,
            self.put_claims,
        )
        rec["bytes_in"] = sum(sizes)
        return {"stored": stored, "raced": rec["num_raced"], "evicted": 0}, []

    def _op_delete(
        self,
        header: dict[str, Any],
        tenant: str,
        ikeys: list[str],
        frames: Sequence[Any],
        rec: dict[str, Any],
    ) -> _Body:
        deleted = self.store.delete_many(ikeys) if ikeys else 0
        self.usage.remove(ikeys)
        return {"deleted": deleted}, []

    def _op_stats(
        self,
        header: dict[str, Any],
        tenant: str,
        ikeys: list[str],
        frames: Sequence[Any],
        rec: dict[str, Any],
    ) -> _Body:
        mine = self.usage.snapshot().get(tenant, {"bytes": 0, "keys": 0})
        return {"stats": {"namespace": tenant, **mine}}, []

    def _shm_region(
        self, header: dict[str, Any], tenant: str
    ) -> tuple[shm.ShmSegment | None, int, int]:
        return shm_region(self._segments, header, tenant)


def _buffer(frame: zmq.Frame | bytes) -> memoryview:
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
