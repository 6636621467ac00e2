"""Garbage collections of this process, timed (for the step log).

A CPython collection runs on whichever thread allocates when a threshold is crossed, so a
collection on the engine thread lands inside some step's inputs, hook or forward launch and
shows there as CPU time with nothing else to explain it. ``GcClock`` records each collection's
wall-clock start, duration and generation through ``gc.callbacks``; ``take(since)`` returns
the collections that started at or after ``since`` and forgets every one recorded so far.
Callbacks run on the collecting thread, under the GIL: the list needs no lock beyond it.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcClock:
    """Installs a ``gc.callbacks`` entry until ``close``."""

    def __init__(self) -> None:
        self._events: list[tuple[float, float, int]] = []  # (wall start, seconds, generation)
        self._start: tuple[float, float] | None = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = (time.time(), time.perf_counter())
        elif self._start is not None:
            wall, t0 = self._start
            self._start = None
            self._events.append((wall, time.perf_counter() - t0, int(info.get("generation", 0))))

    def take(self, since: float) -> tuple[float, int]:
        """Seconds spent in collections that started at wall time ``since`` or later, and the
        oldest generation among them (-1: none); every recorded collection is dropped."""
        events, self._events = self._events, []
        seconds, generation = 0.0, -1
        for wall, secs, gen in events:
            if wall >= since:
                seconds += secs
                generation = max(generation, gen)
        return seconds, generation

    def close(self) -> None:
        """Removes the callback; idempotent."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
