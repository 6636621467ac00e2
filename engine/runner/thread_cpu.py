"""CPU time of the process's other Python threads, read from the engine thread.

A step's launches hold the GIL only between torch calls, each of which releases it: when
another Python thread of the engine process is runnable (the KV save's seal thread, a load
or prefetch thread, a tier's writer), the engine thread waits for it at every call, up to
``sys.getswitchinterval()`` each time. ``OtherThreadsCpu.total()`` sums the CPU clocks of
every other live ``threading`` thread (``time.pthread_getcpuclockid``), so the model runner
can log how much of a step's ``forward`` other threads ran through (step part
``others_cpu``), and ``busiest()`` names them once a run ends.

Threads that started and ended between two reads are missed; C threads that never hold
the GIL (ZMQ's, OpenMP's, the CUDA driver's) are not counted, on purpose.
"""

from __future__ import annotations

import threading
import time


class OtherThreadsCpu:
    """Reads the CPU clocks of the live Python threads other than the one that built it."""

    def __init__(self) -> None:
        self._own = threading.get_ident()
        self._clocks: dict[int, tuple[str, int]] = {}  # ident -> (name, clock id)
        self._seen = -1  # threading's count when the clocks were last listed
        self._supported = hasattr(time, "pthread_getcpuclockid")

    def _refresh(self) -> None:
        count = threading.active_count()
        if count == self._seen:
            return
        self._seen = count
        clocks: dict[int, tuple[str, int]] = {}
        for thread in threading.enumerate():
            ident = thread.ident
            if ident is None or ident == self._own or not thread.is_alive():
                continue
            try:
                clocks[ident] = (thread.name, time.pthread_getcpuclockid(ident))
            except OSError:  # ended meanwhile
                continue
        self._clocks = clocks

    def by_thread(self) -> dict[str, float]:
        """CPU seconds so far of each other live thread, by name (same names summed)."""
        if not self._supported:
            return {}
        self._refresh()
        out: dict[str, float] = {}
        for ident, (name, clock) in list(self._clocks.items()):
            try:
                cpu = time.clock_gettime(clock)
            except OSError:  # the thread ended: list again next time
                self._clocks.pop(ident, None)
                self._seen = -1
                continue
            out[name] = out.get(name, 0.0) + cpu
        return out

    def total(self) -> float:
        """CPU seconds so far of the other live threads together (0.0 where unsupported)."""
        return sum(self.by_thread().values())

    def busiest(self, n: int = 6) -> list[tuple[str, float]]:
        """The ``n`` other threads with the most CPU time so far, most first."""
        ranked = sorted(self.by_thread().items(), key=lambda kv: -kv[1])
        return [(name, round(cpu, 3)) for name, cpu in ranked[:n]]
