"""Same-host fast path: block payloads move through a POSIX shared-memory segment.

Ownership and lifetime (the whole design):

- The **client** creates one segment per thread (``ShmSegment.create``) under ``/dev/shm`` with
  an unguessable name ``kvtier-c-<pid>-<128 random bits>``, maps it, and sends its name in a
  ``hello``. The daemon maps it too (``ShmSegment.attach``) and answers; the client then
  **unlinks the name at once**. From then on the memory lives exactly as long as the two
  mappings: no name is left in ``/dev/shm`` even if either process is killed.
- The daemon never creates segments. It keeps at most ``max_attached`` mappings (LRU), each
  bound to the tenant whose token attached it; a request naming a segment it does not hold, or
  one attached by another tenant, gets ``SHM_UNAVAILABLE`` and the client falls back to frames.
- A put: the client writes payloads into its segment and sends offsets; the daemon copies them
  out before answering. A get: the daemon writes values into the client's segment at offsets it
  returns; the client hands out memoryviews of its own segment, valid until its next call on
  that thread (the Tier contract). Whatever does not fit travels as frames.

Linux only (``/dev/shm``); ``available()`` says whether it can work here. Not thread-safe per
segment: one segment belongs to one client thread, and the daemon's ``AttachedSegments`` takes a
lock.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass

SHM_DIR = "/dev/shm"
NAME_RE = re.compile(r"kvtier-c-[0-9]+-[0-9a-f]{32}")


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def host_id() -> str:
    """Identity of this machine (and boot): equal ids mean /dev/shm may be shared."""
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(path) as f:
                return f"{os.uname().nodename}:{f.read().strip()}"
        except OSError:
            continue
    return os.uname().nodename


class ShmSegment:
    """One mapped segment. ``buf`` is a writable memoryview of the whole mapping."""

    def __init__(self, name: str, mapping: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.size = len(mapping)
        self._mmap = mapping
        self._owner = owner
        self._unlinked = not owner
        self.buf = memoryview(mapping)

    @classmethod
    def create(cls, size: int) -> ShmSegment:
        """Create and map a fresh segment of ``size`` bytes. Raises OSError."""
        name = f"kvtier-c-{os.getpid()}-{secrets.token_hex(16)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(name, mapping, owner=True)

    @classmethod
    def attach(cls, name: str, max_size: int) -> ShmSegment:
        """Map an existing segment by name. Raises ValueError for a foreign name, OSError."""
        if not NAME_RE.fullmatch(name):
            raise ValueError(f"not a kvtier segment name: {name[:80]!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if not 0 < size <= max_size:
                raise ValueError(f"segment of {size} bytes outside (0, {max_size}]")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, mapping, owner=False)

    def unlink(self) -> None:
        """Remove the name (the memory stays until every mapping closes). Idempotent."""
        if not self._unlinked:
            self._unlinked = True
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unmap (and unlink if still named and owned). Views handed out must be gone."""
        self.unlink()
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:
            # A caller still holds a view: the mapping is freed when the last view dies.
            pass


@dataclass(frozen=True, slots=True)
class Attached:
    segment: ShmSegment
    tenant: str


class AttachedSegments:
    """The daemon's mappings of client segments: LRU-bounded, tenant-bound, thread-safe."""

    def __init__(self, max_attached: int, max_segment_bytes: int) -> None:
        self._max_attached = max_attached
        self._max_segment_bytes = max_segment_bytes
        self._lock = threading.Lock()
        self._by_name: OrderedDict[str, Attached] = OrderedDict()

    def attach(self, name: str, tenant: str) -> ShmSegment:
        """Map ``name`` for ``tenant``. Raises ValueError/OSError when it cannot."""
        with self._lock:
            held = self._by_name.get(name)
            if held is not None:
                if held.tenant != tenant:
                    raise ValueError("segment belongs to another namespace")
                return held.segment
        segment = ShmSegment.attach(name, self._max_segment_bytes)
        with self._lock:
            self._by_name[name] = Attached(segment, tenant)
            while len(self._by_name) > self._max_attached:
                _, old = self._by_name.popitem(last=False)
                old.segment.close()
        return segment

    def get(self, name: str, tenant: str) -> ShmSegment | None:
        with self._lock:
            held = self._by_name.get(name)
            if held is None or held.tenant != tenant:
                return None
            self._by_name.move_to_end(name)
            return held.segment

    def detach(self, name: str, tenant: str) -> None:
        with self._lock:
            held = self._by_name.get(name)
            if held is not None and held.tenant == tenant:
                del self._by_name[name]
                held.segment.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_name)

    def close(self) -> None:
        with self._lock:
            for held in self._by_name.values():
                held.segment.close()
            self._by_name.clear()
