"""The store's idle-tier prober: a thread that pings, every ``StoreConfig.probe_interval_s``,
each tier no call reached meanwhile (``GuardedTiers.probe_idle``).

Why: a tier's health (``consecutive_failures``, what ``/health`` reports) changes only when a
call reaches it. Without probes an idle engine keeps showing a Redis that died as up until the
next request touches it, and a tier that came back as down until its backoff's first call.
A probe is ``Tier.ping`` (a header-only round trip; nothing for in-process tiers), so it costs
a backend next to nothing and touches no key. Torch-free.
"""

from __future__ import annotations

import threading

from cachestore.store.guarded_tiers import GuardedTiers


class TierProber:
    """Started by ``start``; ``stop`` ends it (idempotent, waits up to ``join_timeout_s`` for a
    probe in flight). The thread is a daemon: a process never waits on it to exit."""

    def __init__(self, tiers: GuardedTiers, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._tiers = tiers
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-tier-prober", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._tiers.probe_idle(self._interval_s)

    def stop(self, join_timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(join_timeout_s)
