"""Whether a block a lower tier holds is worth saving into the top tier again.

An engine frees a GPU block it had loaded from a lower tier (LMDB, say) and offers it for
saving like any other. Saving it into the top (host) tier again costs a device-to-host copy and
a checksum, and evicts another block; it pays when the block is read from the top tier before
that tier evicts it in turn (a promotion). When the top tier is smaller than the span between
two uses of a block, it never is: the production-stack QA client with a 2 GiB host tier over
LMDB (issue 28's shape) saved 20,814 blocks into the host tier on an H200, 13,700 of them
blocks LMDB already held, and read none of them back from the host tier (every reuse came
from LMDB); its seal thread spent 8 s of CPU over the 55 s run, against 2.4 s with a host tier
that holds everything.

``ResaveGate`` watches what happens to such re-saved blocks: the top tier reports, among the
entries it evicted that a lower tier held when they came in, how many were never read
(``HostTier.resave_outcomes``). Over each window of ``WINDOW`` such evictions, a share unread
of ``UNREAD`` or more turns re-saving off (``filter`` drops the keys a lower tier holds, all
but one in ``PROBE``, which keep the measurement going); a window under it turns it back on.
A top tier with room evicts nothing, so the gate stays open: re-saving then costs no eviction,
and blocks come back to the host tier after a restart. Blocks no lower tier holds are always
saved. Thread-safe; torch-free.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

WINDOW = 64  # evictions of re-saved blocks per verdict
UNREAD = 0.9  # share of them evicted unread that turns re-saving off
PROBE = 8  # while off, one re-save in PROBE still goes in


class ResaveGate:
    def __init__(self, outcomes: Callable[[], tuple[int, int]]) -> None:
        """``outcomes()``: the top tier's running counts of (evicted re-saved blocks, those
        of them never read), both monotonic."""
        self._outcomes = outcomes
        self._lock = threading.Lock()
        self._base = outcomes()
        self._off = False
        self._seen = 0  # re-saves offered while off (every PROBE-th goes in)

    @property
    def off(self) -> bool:
        """Whether re-saving is off now (as of the last ``filter``)."""
        return self._off

    def filter(self, keys: Sequence[str], held_below: Callable[[str], bool]) -> list[str]:
        """``keys`` to save, in order: all of them while re-saving pays, else those no lower
        tier holds (``held_below``) and one re-save in ``PROBE``."""
        with self._lock:
            self._update()
            if not self._off:
                return list(keys)
            out: list[str] = []
            for key in keys:
                if held_below(key):
                    self._seen += 1
                    if self._seen % PROBE:
                        continue
                out.append(key)
            return out

    def _update(self) -> None:
        evicted, unread = self._outcomes()
        base_evicted, base_unread = self._base
        if evicted - base_evicted < WINDOW:
            return
        self._off = (unread - base_unread) >= UNREAD * (evicted - base_evicted)
        self._base = (evicted, unread)
