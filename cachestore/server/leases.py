"""Zero-copy same-host gets: a doorbell client reads the daemon's host slab in place, under a
lease.

What a lease is: a get whose blocks the host tier holds is answered with where they lie in the
slab (``slab_offsets``) instead of a copy; the daemon keeps each block pinned (the host tier's
counted pins: a pinned entry is never evicted, overwritten or deleted, so its bytes stay put)
until the client gives the lease back. The client maps the slab read-only (a sealed memfd it
got over the doorbell, ``tiers.host_memfd``) and hands out views of that mapping.

Lifetime, on the daemon's side (``ConnLeases``, one per doorbell connection):
- granted per request, all keys or none (a miss, a foreign header, or the caps -> the copy path);
- released all together when a request carries ``release: true`` (the client sets it on the
  first request of its next call: the Tier contract keeps values valid until then), and when
  the connection closes for any reason (client closed, crashed or was killed);
- capped: at most ``max_conn_bytes`` held per connection and ``LeaseBudget`` over all of them;
  past either, gets are copied as before, so a client that never calls again pins little.

Security: only offered when every block in the slab belongs to one namespace the client may
read whole (``CacheServer``: open mode, or a token table of one unrestricted tenant). With
several tenants the slab is never mapped by any client.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from cachestore.server.reads import HostReads
from cachestore.store.hierarchical import HierarchicalStore
from cachestore.store.loads import LoadSpec
from tiers.host import HostTier
from tiers.remote.protocol import Request


class LeaseBudget:
    """Leased bytes over every connection, capped. Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self.held_bytes = 0  # a gauge (tests, metrics)
        self.num_granted = 0  # blocks leased so far (a count)

    def take(self, nbytes: int, num_blocks: int) -> bool:
        """Reserve ``nbytes`` if they fit under the cap; False (nothing taken) otherwise."""
        with self._lock:
            if self.held_bytes + nbytes > self.max_bytes:
                return False
            self.held_bytes += nbytes
            self.num_granted += num_blocks
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.held_bytes -= nbytes


class ConnLeases:
    """One doorbell connection's leases: the prepared loads (``LoadSpec``) pinning host
    blocks for its client, completed together. Not thread-safe: used by its connection's thread only. Never raises for a store
    failure (a grant that fails is a copy-path get)."""

    def __init__(self, store: HierarchicalStore, budget: LeaseBudget, max_conn_bytes: int) -> None:
        self._store = store
        self._budget = budget
        self._max_conn_bytes = max_conn_bytes
        self._specs: list[LoadSpec] = []
        self.held_bytes = 0

    def grant(self, reads: HostReads, req: Request) -> dict[str, Any] | None:
        """Pin every key of get ``req`` where it lies in the host slab and record the lease:
        the reply body (``sizes``, ``slab_offsets``); None (nothing pinned) when a key is not
        a host hit with the namespace's header, or a cap is reached."""
        keys: list[str] = req.header["keys"]
        hint = reads.hint(req.tenant, keys[0].split("/", 1)[0])
        if hint is None:
            return None
        nbytes = hint[1] * len(keys)
        if self.held_bytes + nbytes > self._max_conn_bytes or not self._budget.take(
            nbytes, len(keys)
        ):
            return None
        located = reads.locate(req.tenant, keys, req.ikeys)
        if located is None or located.block_bytes * len(keys) != nbytes:  # the hint moved
            if located is not None:
                self._store.complete_load(located.spec)
            self._budget.give(nbytes)
            return None
        self._specs.append(located.spec)
        self.held_bytes += nbytes
        req.rec.update(num_hits=len(keys), bytes_out=nbytes, path="shm")
        return {
            "sizes": [located.block_bytes] * len(keys),
            "slab_offsets": list(located.spec.host_offsets),
        }

    def release(self) -> None:
        """Give back every lease of this connection (unpin, budget). Idempotent."""
        if not self._specs:
            return
        specs, self._specs = self._specs, []
        nbytes, self.held_bytes = self.held_bytes, 0
        try:
            for spec in specs:
                self._store.complete_load(spec)
        finally:
            self._budget.give(nbytes)


@dataclass(frozen=True, slots=True)
class LeaseOffer:
    """What the doorbell needs to grant leases: ``fd``, the host slab's sealed memfd (a dup
    the offer owns: ``close`` it after the doorbell stopped), the store, the budget over all
    connections and the cap per connection."""

    fd: int
    store: HierarchicalStore
    budget: LeaseBudget
    max_conn_bytes: int

    @classmethod
    def build(
        cls, store: HierarchicalStore, one_namespace: bool, max_bytes: int, max_conn_bytes: int
    ) -> LeaseOffer | None:
        """An offer when the store's top tier is a shared-slab ``HostTier`` and its blocks
        all belong to one namespace every client may read whole (``one_namespace``); else
        None (in-place reads are never offered, gets copy). The budget is at most a quarter
        of the slab, so leases can never pin the host tier full."""
        slab = store.host_slab()
        fd = slab.shared_fd() if isinstance(slab, HostTier) and one_namespace else None
        if fd is None or max_bytes <= 0 or max_conn_bytes <= 0:
            return None
        capacity = slab.usage().capacity_bytes or 0  # type: ignore[union-attr]
        return cls(os.dup(fd), store, LeaseBudget(min(max_bytes, capacity // 4)), max_conn_bytes)

    def open(self) -> ConnLeases:
        """A fresh connection's (empty) leases."""
        return ConnLeases(self.store, self.budget, self.max_conn_bytes)

    def close(self) -> None:
        os.close(self.fd)
