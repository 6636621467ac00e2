"""Per-tenant accounting of the cache daemon: bytes and keys each namespace stored.

Feeds the namespace quota (``ServerLimits.max_namespace_bytes``), ``/stats`` and the
``kvtier_server_namespace_*`` gauges. Internal keys are ``tenant/prefix/hex`` (see
``cachestore.server.ops``), so a key names its tenant.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence


class NamespaceUsage:
    """Bytes and keys each tenant stored through this daemon (for quotas and /stats).

    Counts what was put since the daemon started, minus deletes and the keys the store dropped
    at its bottom tier (``HierarchicalStore(on_drop=...)``); keys a previous run left in LMDB
    are not counted until overwritten. An approximation by design: a key the bottom tier
    dropped while an upper tier still holds it stops counting early. Thread-safe; the quota
    check and the update are not one atomic step, so concurrent puts of one tenant may
    overshoot its quota by at most one request each.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key_bytes: dict[str, int] = {}
        self._tenant_bytes: dict[str, int] = {}
        self._tenant_keys: dict[str, int] = {}

    def delta(self, tenant: str, items: Sequence[tuple[str, int]]) -> int:
        """How many bytes storing ``items`` (internal key, size) would add. No side effect."""
        with self._lock:
            return sum(size - self._key_bytes.get(k, 0) for k, size in items)

    def used(self, tenant: str) -> int:
        with self._lock:
            return self._tenant_bytes.get(tenant, 0)

    def add(self, tenant: str, items: Sequence[tuple[str, int]]) -> None:
        """Record stored ``items``; an overwrite replaces the key's old size."""
        with self._lock:
            for key, size in items:
                old = self._key_bytes.get(key)
                self._key_bytes[key] = size
                self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + size - (old or 0)
                if old is None:
                    self._tenant_keys[tenant] = self._tenant_keys.get(tenant, 0) + 1

    def remove(self, keys: Sequence[str]) -> None:
        """Forget internal keys (deleted or dropped); unknown keys are ignored."""
        with self._lock:
            for key in keys:
                size = self._key_bytes.pop(key, None)
                if size is not None:
                    tenant = key.split("/", 1)[0]
                    self._tenant_bytes[tenant] -= size
                    self._tenant_keys[tenant] -= 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {
                t: {"bytes": b, "keys": self._tenant_keys.get(t, 0)}
                for t, b in sorted(self._tenant_bytes.items())
            }
