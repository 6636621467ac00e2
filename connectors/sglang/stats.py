"""The SGLang backend's counters. Torch-free, SGLang-free.

``Counters`` keeps totals since start (``totals``: the stats file, ``stats()``) and the
per-call page counts and bandwidths SGLang's ``StorageMetrics`` wants since its last
``get_stats`` (``take_window``: prefetch = reads, backup = writes, GB/s). The store's own
per-tier counters (hits, misses, corrupt, wrong_key, errors, bytes, latency) sit beside them
in ``KvtierHiCacheStorage.stats()``. Thread-safe (one lock): SGLang reads from its prefetch
thread and writes from its backup thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

COUNTERS: dict[str, str] = {
    "exists_pages": "pages SGLang asked about",
    "exists_hits": "leading pages found in the tiers",
    "get_pages": "pages SGLang asked to read",
    "get_hits": "pages read into SGLang's host pool",
    "get_misses": "pages absent, corrupt or of another key in every tier",
    "get_bad_layout": "pages found but of another size or header (a miss)",
    "set_pages": "pages SGLang asked to write",
    "set_present": "pages already in the tiers (not rewritten)",
    "set_written": "pages written to the top tier",
    "set_failed": "pages whose write failed (tier down or backing off)",
    "get_bytes": "payload bytes read",
    "set_bytes": "payload bytes written",
    "get_seconds": "seconds in reads",
    "set_seconds": "seconds in writes",
}


@dataclass
class StorageWindow:
    """SGLang's ``StorageMetrics`` fields (``observability.metrics_collector``), duck-typed:
    that module cannot be imported without SGLang's CUDA stack, and SGLang's collector only
    reads these attributes (and may set ``prefetch_stats`` on the object)."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


class Counters:
    def __init__(self, page_bytes: int = 0) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self.page_gb = page_bytes / 1e9
        self._window: tuple[list[int], list[int], list[float], list[float]] = ([], [], [], [])

    def add(self, **increments: float) -> None:
        """Add to named counters; an unknown name raises KeyError (a typo is a bug)."""
        with self._lock:
            for name, value in increments.items():
                if name not in COUNTERS:
                    raise KeyError(f"unknown kvtier counter {name!r}")
                self._totals[name] += value

    def record(self, write: bool, pages: int, seconds: float) -> None:
        """One read (``write`` False) or write call of ``pages`` pages, for SGLang's window."""
        if pages <= 0:
            return
        with self._lock:
            pgs, bw = (
                (self._window[1], self._window[3]) if write else (self._window[0], self._window[2])
            )
            pgs.append(pages)
            bw.append(pages * self.page_gb / max(seconds, 1e-9))

    def take_window(self) -> StorageWindow:
        """The pages and bandwidths of the calls since the last ``take_window`` (cleared)."""
        with self._lock:
            out, self._window = self._window, ([], [], [], [])
        return StorageWindow(*out)

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._totals)
