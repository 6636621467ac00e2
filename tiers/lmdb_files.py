"""The LMDB tier's files (``tiers.lmdb``): disk blocks for every write, the data file it has
open, and an environment that is no longer readable. Each keeps the tier's contract: a cache
that fails degrades to misses, and never takes the process down or keeps it from starting.

- **Room for a write** (``DataFile.reserve``). With ``writemap`` LMDB writes pages through a
  shared mapping of a sparse file: a page with no disk block behind it gets one when it is first
  written, and on a full filesystem that is a SIGBUS, not an error (the engine died, and again on
  every restart). So before each write transaction the writer makes the file own blocks from
  its high-water mark (past the last page LMDB ever used) to as far as that transaction may
  grow it, with ``posix_fallocate`` in steps of ``RESERVE_STEP``. Out of space, that is a clean
  ``DiskFull`` for the write (nothing written); puts work again once space is freed. Pages
  below the mark are backed already (LMDB wrote every page it used), so a full tier reusing the
  pages its evictions freed needs no new block and keeps writing on a full disk. Through
  ``write(2)`` (``writemap: false``, the default) a full disk is no SIGBUS but an ``ENOSPC`` in
  the middle of LMDB's commit; the same reservation makes it that ``DiskFull``, before anything
  is written. Allocating ahead cost nothing measurable (docs/tiers.md, with ``writemap``:
  fresh-file 2 MiB puts at 0.57-0.59 GB/s median with it, 0.51-0.53 without, same process,
  interleaved); a ``statvfs`` check before
  each transaction instead ran no faster and another process can race it. Where the
  filesystem cannot allocate ahead, glibc's emulation writes a byte per block (slower, still
  safe). On copy-on-write filesystems (btrfs, ZFS) a rewritten page needs a new block too.
- **The file it has open** (``DataFile.check_same``): a directory deleted or replaced under a
  running tier left it writing into an unlinked file, reported healthy, and lost everything at
  the next restart. The tier compares the file at its path with the one it opened.
- **An unreadable environment** (``open_or_move_aside``): a corrupt or foreign-version
  ``data.mdb`` stopped every start. It is a cache: the directory is renamed to
  ``<path>.corrupt-<UTC time>`` (kept for a post-mortem) and an empty one opened, unless a live
  process has the environment open (LMDB's lock on ``lock.mdb``), which stays a start-up error.

Linux (``F_OFD_SETLK``, ``posix_fallocate``); torch-free.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tiers.base import TierError
from tiers.sizes import approx_size

log = logging.getLogger(__name__)

DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
# Blocks allocated past what a write needs, so most writes find them there (no system call):
# a quarter of what the file holds, at most RESERVE_STEP (a small tier takes no more disk).
RESERVE_STEP = 64 << 20
# Per item written or deleted: the leaf-to-root copies in ``blocks`` and ``recency`` and those of
# an eviction it causes. Per transaction: page splits and the free list's own record.
PAGES_PER_ITEM = 16
WRITE_SLACK = 256 << 10

T = TypeVar("T")


class DiskFull(TierError):
    """The filesystem has no room for what a write may need; nothing was written."""


class DataFileLost(TierError):
    """The data file at the tier's path is not the one it has open (deleted or replaced)."""


def write_need(value_sizes: list[int], other_items: int, psize: int) -> int:
    """Bytes a write transaction may add past the file's high-water mark: each value's overflow
    pages (a 16-byte page header first), ``PAGES_PER_ITEM`` pages per value and per other item
    (a delete, a recency record) and ``WRITE_SLACK``. An upper bound unless one transaction
    evicts hundreds of small blocks from a file with no free pages (``RESERVE_STEP`` covers
    that)."""
    pages = sum(-(-(n + 16) // psize) for n in value_sizes)
    pages += (len(value_sizes) + other_items) * PAGES_PER_ITEM
    return pages * psize + WRITE_SLACK


class DataFile:
    """The environment's ``data.mdb``, opened once more (for ``posix_fallocate`` and its
    identity). LMDB locks ``lock.mdb``, never this file, so closing it drops no lock of theirs.
    Not thread-safe: the tier's writer (and ``ping``, which only reads the identity) use it."""

    def __init__(self, directory: str, map_size: int, psize: int) -> None:
        self.path = os.path.join(directory, DATA_FILE)
        self._map_size = map_size
        self._psize = psize
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise TierError(f"lmdb open at {self.path}: {exc.strerror or exc}") from None
        st = os.fstat(self._fd)
        self._identity = (st.st_dev, st.st_ino)
        self._reserved_end = 0  # this process's allocations reach this far (at least)
        # LMDB maps ``lock.mdb`` too (the reader table, sparse past its first page): a reader
        # slot on a page without a block is a SIGBUS on a full disk, as a data page is. It
        # gets its blocks with the first reservation. The fd stays open until ``close``:
        # closing any fd of that file drops this process's record lock on it, LMDB's mark
        # that the environment is in use.
        try:
            self._lock_fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CLOEXEC)
            self._table_backed = False
        except OSError:  # no reader table (MDB_NOLOCK) or none this process may write
            self._lock_fd, self._table_backed = -1, True

    def allocated_bytes(self) -> int:
        """Disk blocks the file holds now (it is sparse: its size is the map's)."""
        return os.fstat(self._fd).st_blocks * 512

    def check_same(self) -> None:
        """Raise DataFileLost when ``path`` is gone or another file; TierError when it cannot
        be read (an operator's chmod, an unreachable mount)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise DataFileLost(
                f"lmdb at {os.path.dirname(self.path)}: {self.path} was deleted while the tier "
                "ran; what it writes is lost at exit: restart the process to start afresh"
            ) from None
        except OSError as exc:
            raise TierError(f"lmdb at {self.path}: cannot stat: {exc.strerror or exc}") from None
        if (st.st_dev, st.st_ino) != self._identity:
            raise DataFileLost(
                f"lmdb at {os.path.dirname(self.path)}: {self.path} is no longer the file this "
                "tier has open (the directory was replaced); restart the process to use it"
            )

    def reserve(self, high_water: int, need: int) -> None:
        """Make the file own blocks from ``high_water`` to ``high_water + need`` (and, when it
        must allocate, a step more if the disk has it: ``RESERVE_STEP``), and the reader table
        its own blocks. Raises DiskFull."""
        if not self._table_backed:
            self._fallocate(self._lock_fd, 0, os.fstat(self._lock_fd).st_size, need)
            self._table_backed = True
        end = min(high_water + need, self._map_size)
        step = min(high_water // 4, RESERVE_STEP)
        if self._reserved_end >= min(end + step // 2, self._map_size):
            return  # allocated already, with half a step to spare: no system call
        ahead = min(end + step, self._map_size)
        if ahead > end:
            try:
                self._fallocate(self._fd, high_water, ahead - high_water, need)
                self._reserved_end = max(self._reserved_end, ahead)
                return
            except DiskFull:
                pass  # room for this write only, perhaps
        self._fallocate(self._fd, high_water, end - high_water, need)
        self._reserved_end = max(self._reserved_end, end)

    def _fallocate(self, fd: int, offset: int, length: int, need: int) -> None:
        """``posix_fallocate``; DiskFull when out of space (or quota), else TierError."""
        try:
            os.posix_fallocate(fd, offset, length)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise DiskFull(
                    f"lmdb at {os.path.dirname(self.path)}: the disk is full: "
                    f"{_mib(free_bytes(self.path))} free, this write may need up to "
                    f"{_mib(need)}; skipped (nothing written), writes resume once space is freed"
                ) from None
            raise TierError(
                f"lmdb at {self.path}: cannot allocate disk blocks: {exc.strerror or exc}"
            ) from None

    def close(self) -> None:
        """After the environment is closed (LMDB's lock: see ``__init__``)."""
        os.close(self._fd)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def free_bytes(path: str) -> int:
    """Bytes an unprivileged process may still allocate on ``path``'s filesystem."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def warn_if_disk_smaller(directory: str, capacity: int, data_file: DataFile) -> None:
    """One WARNING when ``capacity`` is more than the disk can give the tier (free space plus
    what the data file holds): not an error, the disk may grow or be cleaned up; writes past
    it fail (``DiskFull``) and degrade to recompute."""
    held = data_file.allocated_bytes()
    free = free_bytes(directory)
    if capacity > free + held:
        log.warning(
            "lmdb at %s: capacity %s is more than the disk can give it (%s free plus %s in its "
            "data file): writes past that fail (the disk is full) and are recomputed instead",
            directory,
            approx_size(capacity),
            approx_size(free),
            approx_size(held),
        )


def open_or_move_aside(directory: str, open_env: Callable[[], T]) -> T:
    """``open_env()``; if LMDB finds the files unreadable (``unreadable_errors``), move the
    directory aside (``move_aside``) and ``open_env()`` again on an empty one. Raises TierError
    when the environment stays unreadable while a live process has it open, or the move fails.
    A live process may also be one that just moved it aside itself and opened a fresh one: so
    then this opens it once more before giving up."""
    try:
        return open_env()
    except TierError as exc:
        if not isinstance(exc.__cause__, unreadable_errors()):
            raise
        why = str(exc.__cause__)
    lock = _exclusive_lock(directory)
    if lock is None:
        try:
            return open_env()
        except TierError as exc:
            if not isinstance(exc.__cause__, unreadable_errors()):
                raise
            raise TierError(
                f"lmdb at {directory}: unreadable ({why}) and open by another process: stop "
                "it, or move or remove the directory, then start again"
            ) from exc
    try:
        move_aside(directory, why)
    finally:
        if lock >= 0:
            os.close(lock)
    Path(directory).mkdir(parents=True, exist_ok=True)
    return open_env()


def unreadable_errors() -> tuple[type[BaseException], ...]:
    """LMDB's errors that mean the files are not (or no longer) a readable environment, as
    opposed to the system's (permissions, a missing directory), which stay start-up errors."""
    import lmdb

    return (
        lmdb.InvalidError,
        lmdb.CorruptedError,
        lmdb.VersionMismatchError,
        lmdb.PageNotFoundError,
    )


def move_aside(directory: str, why: str) -> str:
    """Rename ``directory`` to ``<directory>.corrupt-<UTC time>`` next to it (kept for a
    post-mortem) and log one WARNING naming both; the new name. The caller holds the
    environment's exclusive lock (``_exclusive_lock``), so no process opens it meanwhile.
    Raises TierError when the rename fails."""
    directory = str(Path(directory))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = f"{directory}.corrupt-{stamp}"
    n = 0
    while os.path.exists(aside):
        n += 1
        aside = f"{directory}.corrupt-{stamp}-{n}"
    try:
        os.rename(directory, aside)
    except OSError as exc:
        raise TierError(
            f"lmdb at {directory}: unreadable ({why}) and cannot be moved aside to {aside}: "
            f"{exc.strerror or exc}"
        ) from None
    log.warning(
        "lmdb at %s was unreadable (%s): moved aside to %s, starting empty", directory, why, aside
    )
    return aside


_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux x86-64 and aarch64


def _exclusive_lock(directory: str) -> int | None:
    """An fd holding an open-file-description write lock on byte 0 of ``lock.mdb``, the byte
    every process with the environment open holds a lock on (LMDB's ``mdb_env_excl_lock``);
    -1 when there is no lock file (nobody can have it open); None when another holder exists
    or the file cannot be locked. An OFD lock conflicts with LMDB's record locks whoever holds
    them, this process too. Closing the fd drops this process's record locks on the file: only
    a second environment on this path in this process, which LMDB forbids, would have any."""
    try:
        fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return -1
    except OSError:
        return None
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0))
    except OSError:
        os.close(fd)
        return None
    return fd
