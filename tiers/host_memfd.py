"""Host-tier slab memory that other processes may map read-only: a sealed Linux memfd.

Why: the cache daemon's same-host clients read host blocks in place (``cachestore.server.leases``)
instead of having them copied into their segment. The daemon's ``HostTier(shared=True)``
allocates its slab here; the doorbell passes the fd to a client over its Unix socket
(SCM_RIGHTS), and the client maps it with ``map_readonly``.

Read-only is enforced by the kernel, not by convention: the daemon maps the memfd writable
first, then adds ``F_SEAL_FUTURE_WRITE`` (Linux 5.1+), after which no new writable shared
mapping and no ``write`` is possible for anyone (a re-open through ``/proc``, root included),
while the daemon's own mapping stays writable. ``F_SEAL_SHRINK``/``F_SEAL_GROW`` mean no one can
truncate it under a mapping (no SIGBUS in the daemon), and ``F_SEAL_SEAL`` freezes the seals.
A kernel without these seals gets no shared slab (``create`` raises OSError; callers fall back
to private memory and the copy path).

Torch-free; Linux only (``available``). Not thread-safe by itself (the host tier locks).
"""

from __future__ import annotations

import fcntl
import mmap
import os
from dataclasses import dataclass

# Not in Python 3.11's fcntl module; the value is Linux's (include/uapi/linux/fcntl.h).
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
# What a reader insists on before it maps: nobody can resize it or write through a new mapping.
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE


def available() -> bool:
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")


@dataclass(slots=True)
class SharedSlab:
    """The daemon's side: ``fd`` (sealed memfd; send it, never a writable handle to it) and
    ``view`` (a writable memoryview of the whole slab, the only writable mapping there is)."""

    fd: int
    mapping: mmap.mmap
    view: memoryview

    @classmethod
    def create(cls, num_bytes: int, name: str = "kvtier-host-slab") -> SharedSlab:
        """Allocate ``num_bytes`` (pages come on first touch). Raises OSError when memfds or
        the seals are not supported here."""
        if not available():
            raise OSError("memfd_create or file seals unsupported on this platform")
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, num_bytes)
            mapping = mmap.mmap(fd, num_bytes)  # MAP_SHARED, writable: before the seal
            try:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            except OSError:
                mapping.close()
                raise
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, mapping, memoryview(mapping))

    def close(self) -> None:
        """Unmap and close the fd. Idempotent. A view still held elsewhere keeps the mapping
        alive until it goes (clients' own mappings are theirs)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self.view.release()
            self.mapping.close()
        except BufferError:
            pass  # slices of the view are still out (a reply in flight): freed with them


def map_readonly(fd: int) -> mmap.mmap:
    """Map a received slab fd read-only and close the fd. Raises OSError (and closes the fd)
    unless it is a sealed slab: a mapping of a file someone can shrink could SIGBUS us."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & REQUIRED_SEALS != REQUIRED_SEALS:
            raise OSError(f"slab fd is not sealed (seals {seals:#x})")
        size = os.fstat(fd).st_size
        if size <= 0:
            raise OSError("empty slab")
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
