"""Recycled read buffers: a tier's ``get_many`` copies values once into memory that is already
faulted in, instead of into a fresh ``bytes`` per value.

Why: a fresh multi-megabyte allocation comes from ``mmap`` (or a heap the allocator just
trimmed), so the copy into it page-faults on every 4 KiB page; on a CPU host that caps a
page-cached LMDB read at a small fraction of memcpy speed. A buffer that is reused stays mapped.

``ReadBuffers.take(n)`` hands out a memoryview of ``n`` bytes at the front of a pooled
``bytearray``; slices of it are the values a tier returns. A buffer goes back to the pool by
itself once no view of it is alive (CPython reference counting: the pool's own reference is the
only one left), so values stay valid for as long as the caller holds them, like ``bytes``. A
caller that holds one value of a large batch keeps that whole batch buffer out of the pool.

At most ``max_idle_bytes`` of idle buffers are kept; a request above ``max_buffer_bytes`` gets
a buffer of its own that is never pooled. Thread-safe.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

_ALIGN = 1 << 21  # sizes round up to 2 MiB, so batches of similar size share buffers


class ReadBuffers:
    def __init__(self, max_idle_bytes: int = 256 << 20, max_buffer_bytes: int = 1 << 30) -> None:
        if max_idle_bytes < 0 or max_buffer_bytes <= 0:
            raise ValueError("max_idle_bytes must be >= 0 and max_buffer_bytes positive")
        self.max_idle_bytes = max_idle_bytes
        self.max_buffer_bytes = max_buffer_bytes
        self._lock = threading.Lock()
        self._buffers: list[bytearray] = []  # every pooled buffer, free or lent out

    def take(self, nbytes: int) -> memoryview:
        """A writable view of ``nbytes`` bytes (contents undefined), reused where possible."""
        if nbytes <= 0:
            return memoryview(bytearray(0))
        size = -(-nbytes // _ALIGN) * _ALIGN
        if size > self.max_buffer_bytes:
            return memoryview(bytearray(nbytes))
        with self._lock:
            best: bytearray | None = None
            idle = 0
            for buf in self._buffers:
                # 3 references: the list, the loop variable and getrefcount's argument.
                if sys.getrefcount(buf) <= 3:
                    idle += len(buf)
                    if len(buf) >= size and (best is None or len(buf) < len(best)):
                        best = buf
            if best is not None:
                return memoryview(best)[:nbytes]  # the view holds it: lent out until released
            self._trim(idle + size)
            buf = bytearray(size)
            self._buffers.append(buf)
            return memoryview(buf)[:nbytes]

    def _trim(self, idle: int) -> None:  # lock held; drop idle buffers, largest first
        if idle <= self.max_idle_bytes:
            return
        order = sorted(range(len(self._buffers)), key=lambda i: -len(self._buffers[i]))
        drop = set()
        for i in order:
            if idle <= self.max_idle_bytes:
                break
            if sys.getrefcount(self._buffers[i]) <= 2:  # the list and getrefcount's argument
                idle -= len(self._buffers[i])
                drop.add(i)
        self._buffers = [b for i, b in enumerate(self._buffers) if i not in drop]

    def idle_bytes(self) -> int:
        """Bytes held by buffers no value refers to (tests, metrics)."""
        with self._lock:
            return sum(len(b) for b in self._buffers if sys.getrefcount(b) <= 3)


# Below this a plain slice assignment is as fast; above it numpy's copy, which releases the GIL,
# lets other threads (the engine's step loop, a parallel stage) run during the memcpy.
_NOGIL_COPY_MIN = 64 << 10


def copy_into(dest: memoryview, src: Any) -> None:
    """Copy the bytes of buffer ``src`` to the front of writable byte view ``dest`` (which is
    at least as long), without holding the GIL for a large copy."""
    n = memoryview(src).nbytes
    if n < _NOGIL_COPY_MIN:
        dest[:n] = src
        return
    np.copyto(np.frombuffer(dest, np.uint8, count=n), np.frombuffer(src, np.uint8, count=n))
