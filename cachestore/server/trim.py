"""Return freed payload buffers to the OS: glibc's ``malloc_trim`` on a timer thread.

The daemon's anonymous memory beyond its host tier is bounded by its queues and buffers
(docs/cache_server.md, "Memory"); this bounds what glibc keeps after them. Torch-free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

# glibc raises its mmap threshold after the first free of a large block, so freed 2 MiB
# payload buffers (ZMQ messages, copies) then stay in its per-thread arenas: anonymous RSS
# stayed ~300 MB after a load. A fixed threshold (mmap per buffer) cost page faults on every
# request; a periodic malloc_trim returns the free pages at no cost to the hot path.
TRIM_INTERVAL_S = 2.0


def start_trimming(stop: threading.Event, interval_s: float = TRIM_INTERVAL_S) -> bool:
    """Call glibc's ``malloc_trim(0)`` every ``interval_s`` on a daemon thread until ``stop``
    is set. False (nothing started) where the C library has no malloc_trim."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False

    def run() -> None:
        while not stop.wait(interval_s):
            trim(0)

    threading.Thread(target=run, name="kvtier-trim", daemon=True).start()
    return True
