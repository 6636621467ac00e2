"""The cache daemon's loop-thread path: requests answered without the worker-pool hand-off.

``InlineServer.serve`` answers on the calling (loop) thread what the host tier can serve
whole, and sends the reply while the blocks are still pinned:

- a lookup whose keys the host tier all holds;
- a get whose blocks the host tier all holds with the namespace's header
  (``HostReads.pinned_views``: a prepared load, completed once the reply is sent; over ZMQ,
  lent blocks leave zero copy under pins of their own, ``HostReads.lend``);
- a small put (at most ``INLINE_PUT_BYTES``) of known namespaces into a memory-only store.

``serve_leased`` answers a doorbell get with where its blocks lie in the slab, pinned under
the connection's leases (``cachestore.server.leases``). Anything else -- a miss, a foreign
header, a cap -- is left to the worker pool (the call returns False, nothing sent or pinned).
Host blocks skip the checksum (this daemon checked it on the way in: a put payload, or a
lower-tier read before promotion) but not the stored header and size check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cachestore.server.leases import ConnLeases
from cachestore.server.reads import HostReads, copy_out
from cachestore.server.records import RequestLog, ok_reply
from cachestore.store.hierarchical import HierarchicalStore
from tiers.remote import shm
from tiers.remote.protocol import ErrorCode, ProtocolError, Reply, Request

# A put this small runs on the loop thread (one checksum pass and one copy, ~70 us per 2 MiB)
# rather than paying the pool hand-off; larger ones would hold up other clients' requests.
INLINE_PUT_BYTES = 8 << 20

Send = Callable[[Reply], None]
ShmRegion = Callable[[dict[str, Any], str], tuple[shm.ShmSegment | None, int, int]]


class InlineServer:
    """``OpHandler``'s loop-thread path over the store's host tier (``fast``). ``run`` runs a
    request as the pool would (an inline put); ``inline_puts``: whether puts may run here
    (a store without a durable write-through tier). Thread-safe as ``HostReads`` is."""

    def __init__(
        self,
        store: HierarchicalStore,
        fast: HostReads,
        log: RequestLog,
        run: Callable[[Request], Reply],
        shm_region: ShmRegion,
        inline_puts: bool,
    ) -> None:
        self._store = store
        self._fast = fast
        self._log = log
        self._run = run
        self._shm_region = shm_region
        self._inline_puts = inline_puts
        self.num_inline = 0  # requests served here (a count, for tests and metrics)

    def serve(self, req: Request, send: Send, lend: bool) -> bool:
        """``OpHandler.serve_inline``: True when ``req`` was answered (``send`` called)."""
        if not req.ikeys:
            return False
        if req.op == "put":
            return self._put(req, send)
        if req.op == "lookup":
            return self._lookup(req, send)
        if req.op == "get":
            return self._get(req, send, lend)
        return False

    def _put(self, req: Request, send: Send) -> bool:
        if (
            not self._inline_puts
            or sum(req.header["sizes"]) > INLINE_PUT_BYTES
            or any(
                self._fast.hint(req.tenant, k.split("/", 1)[0]) is None for k in req.header["keys"]
            )
        ):
            return False
        self.num_inline += 1
        send(self._run(req))
        return True

    def _lookup(self, req: Request, send: Send) -> bool:
        if self._fast.lookup(req.ikeys) < len(req.ikeys):
            return False
        req.rec["num_hits"] = len(req.ikeys)
        # Counted before the reply leaves: a client that saw the reply sees the count.
        self.num_inline += 1
        send(self._log.ok(req, {"count": len(req.ikeys)}, []))
        return True

    def _get(self, req: Request, send: Send, lend: bool) -> bool:
        try:
            segment, offset, end = self._shm_region(req.header, req.tenant)
        except ProtocolError:
            return False  # the pool answers it with the error
        pinned = self._fast.pinned_views(req.tenant, req.header["keys"], req.ikeys)
        if pinned is None:
            return False
        spec, views = pinned.spec, pinned.views
        try:
            body, payloads = copy_out(views, segment, offset, end, req.rec, owned=False)
        except Exception:  # e.g. the segment was detached meanwhile: the pool decides
            self._store.complete_load(spec)
            req.rec.update(num_hits=0, bytes_out=0, path="tcp")
            return False
        self.num_inline += 1  # before the reply leaves (see ``_lookup``)
        if lend:  # the lent blocks' pins leave ``spec``, each for its view's lifetime
            self._fast.lend(spec, req.ikeys, views, payloads)
        reply = ok_reply(req, body, payloads)
        del pinned, views, payloads  # a lent block's pin goes with the last reference to its view
        try:
            send(self._log.finish(req, ErrorCode.OK, reply))
            del reply
        finally:
            self._store.complete_load(spec)
        return True

    def serve_leased(self, req: Request, send: Send, leases: ConnLeases) -> bool:
        """``OpHandler.serve_leased``: True when ``req`` was answered with slab offsets."""
        body = leases.grant(self._fast, req) if (req.op == "get" and req.ikeys) else None
        if body is None:
            return False
        self.num_inline += 1
        send(self._log.ok(req, body, []))
        return True
