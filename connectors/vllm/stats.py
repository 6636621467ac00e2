"""The connector's counters. Torch-free, vLLM-free.

``Counters`` holds named integer/float counters; each side adds to its own, and vLLM carries
them (``connectors.vllm.metrics.KvtierStats``) from the workers and the scheduler to the
front end, which exports them as Prometheus counters ``vllm:kvtier_<name>`` (``vllm serve``'s
``/metrics``; ``LLM.get_metrics()`` offline). ``take`` returns and clears the interval's
increments (what vLLM wants each step); ``totals`` keeps the sums since start (the stats file).

Names (``COUNTERS``): scheduler side ``lookups``, ``hit_tokens`` (available in the tiers past
vLLM's own cache), ``planned_load_tokens`` (what the cost model chose to load),
``recompute_decisions``; worker side ``loaded_tokens``, ``load_failed_blocks``,
``saved_blocks``, ``save_dropped_blocks``, ``load_seconds``, ``save_seconds``.
Thread-safe (one lock).
"""

from __future__ import annotations

import threading

COUNTERS: dict[str, str] = {
    "lookups": "requests looked up in kvtier's tiers",
    "hit_tokens": "prompt tokens found in kvtier's tiers past vLLM's own cache",
    "planned_load_tokens": "tokens the cost model chose to load rather than recompute",
    "recompute_decisions": "lookups with a hit the cost model chose to recompute",
    "loaded_tokens": "tokens loaded from kvtier's tiers into vLLM's KV cache",
    "load_failed_blocks": "blocks whose load failed (recomputed by vLLM)",
    "saved_blocks": "full blocks handed to kvtier's store",
    "save_dropped_blocks": "blocks not saved (save queue full or store error)",
    "load_seconds": "seconds spent loading blocks",
    "save_seconds": "seconds spent copying blocks out for saving",
}


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._interval: dict[str, float] = {}
        self._totals: dict[str, float] = dict.fromkeys(COUNTERS, 0)

    def add(self, **increments: float) -> None:
        """Add to named counters; an unknown name raises KeyError (a typo is a bug)."""
        with self._lock:
            for name, value in increments.items():
                if name not in COUNTERS:
                    raise KeyError(f"unknown kvtier counter {name!r}")
                if value:
                    self._interval[name] = self._interval.get(name, 0) + value
                    self._totals[name] += value

    def take(self) -> dict[str, float]:
        """The increments since the last ``take`` (cleared)."""
        with self._lock:
            out, self._interval = self._interval, {}
            return out

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._totals)
