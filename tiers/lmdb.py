"""LMDB tier: encoded blocks on local disk, capacity-bounded LRU, one writer thread.

- Files: one LMDB environment at ``path`` with two sub-databases: ``blocks`` (key -> encoded
  block) and ``recency`` (key -> last-access sequence, u64 LE). The map size is the capacity plus
  ``map_headroom`` (B-tree pages and free-list overhead) so that eviction, not MDB_MAP_FULL,
  bounds the data.
- LRU: an in-memory index (key -> size, least recent first) is rebuilt on open from ``recency``,
  so a restarted process keeps serving what was stored, in the same eviction order. ``get_many``
  never takes the index lock (the writer holds it through a whole write transaction): its hits
  go to a queue that the writer drains before it evicts, and that ``lookup``, ``pin`` and
  ``lru_keys`` drain first too. Recency reaches disk lazily, in the writer's next transaction.
- One writer (``tiers.lmdb_writer``): ``put_many`` and ``delete_many`` go through a bounded
  queue to a single writer thread and WAIT for their write transaction to commit, so their
  return value (evictions, counts) is exact. Readers run in parallel in their own read-only transactions.
- ``get_many`` reads with ``buffers=True`` and copies each value once out of the map before the
  read transaction ends (an LMDB buffer dies with it), into one recycled buffer per call
  (``tiers.buffers``: memory already faulted in, so the copy runs at memcpy speed): it returns
  memoryviews valid for as long as the caller holds them. ``get_many_into`` copies straight
  from the map into the caller's buffers. ``lookup`` answers from the in-memory index.
- Pins (``pin``/``unpin``, counted) keep entries from eviction, as in the host tier.
- Several processes (engines of one machine on the default directory, the ranks of a
  tensor-parallel engine) may open one ``path``. The capacity is the directory's: its byte
  count (``meta`` sub-database, key ``USED``) changes in the same write transactions as the
  blocks, and a writer evicts its own least recent entries until the directory, every
  process's blocks together, fits (a victim another process already deleted frees nothing and
  leaves the index; a writer with no victim left takes the blocks others wrote since it opened
  in as its least recent). Each process's index holds what it wrote, what was there when it opened,
  and what it found since: ``lookup`` and ``contains_many`` ask the directory for the keys the
  index lacks (one read transaction), so an engine finds another's blocks without a restart;
  a read that misses an indexed key (another process evicted it) drops it from the index.
  Recency sequences are per process, so the order rebuilt on open mixes them.
- Every ``lmdb.Error`` becomes ``TierError``.
- The files (``tiers.lmdb_files``): before each write transaction the writer allocates the disk
  blocks it may need (with ``writemap`` a page the disk cannot back is a SIGBUS; out of space it
  is a TierError, ``DiskFull``), and checks that the data file at ``path`` is still the one open
  (deleted or replaced: ``ping`` and every call raise from then on, restart). An environment
  LMDB cannot read is moved aside at open and an empty one started.

Thread-safe.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiers import lmdb_envs
from tiers.base import Evicted, Tier, TierError, TierUsage, Value, writable_views
from tiers.buffers import ReadBuffers, copy_into
from tiers.lmdb_files import (
    DataFile,
    DiskFull,
    open_or_move_aside,
    warn_if_disk_smaller,
    write_need,
)
from tiers.lmdb_writer import SEQ, STOP, USED, LmdbWriter, WriteOp, guard

log = logging.getLogger(__name__)

_DRAIN_AT = 4096  # queued read hits past which a reader applies them itself (if the lock is free)


class LmdbTier(LmdbWriter, Tier):
    name = "lmdb"
    owns_read_values = True  # get_many: views of recycled buffers (tiers.buffers)

    def __init__(
        self,
        path: str | Path,
        capacity_bytes: int,
        *,
        map_headroom: float = 0.25,
        writer_queue_size: int = 256,
        sync: bool = False,
        read_buffer_bytes: int = 256 << 20,
        writemap: bool = False,
    ) -> None:
        """Open (creating if needed) the environment and rebuild the LRU index.

        ``read_buffer_bytes``: idle read buffers ``get_many`` keeps for reuse (``tiers.buffers``).
        ``writemap``: the writer writes pages through the shared map instead of ``write(2)``
        calls (LMDB's ``MDB_WRITEMAP``). Off by default: faster (2 MiB puts 2.3x into a fresh
        file, up to 8x reusing freed pages on the 2-core CI machine) only while the map's dirty
        pages stay under the kernel's background writeback threshold; past it (a tier larger
        than ~10% of RAM, e.g. any write-through LMDB of a long QA run) the puts fell below
        the ``write(2)`` path's (0.22 against 0.37 GB/s) and the engine thread's steps slowed
        up to 4x beside them (docs/tiers.md). The data file's blocks are allocated a step
        ahead of the writes either way (``tiers.lmdb_files``).
        An environment LMDB cannot read (corrupt, another version) is moved aside to
        ``<path>.corrupt-<UTC time>`` and an empty one opened (``open_or_move_aside``).
        Raises TierError when LMDB cannot open ``path`` otherwise, or it is unreadable and
        another live process has it open.
        """
        self.path = str(path)
        self.capacity_bytes = capacity_bytes
        Path(self.path).mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # guards the index, dirty recency and _seq (pins: _pin_lock)
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> nbytes, least recent first
        self._pins: dict[str, int] = {}
        self._pin_lock = threading.Lock()  # guards _pins' counts (see pin)
        self._dirty: dict[str, int] = {}  # key -> seq not yet written to ``recency``
        self._used_bytes = 0  # the directory's value bytes, every process's (meta USED)
        # Keys another process wrote, found on disk by a lock-free ``lookup`` (key -> size):
        # answered at once, folded into the index by the writer, which holds the lock.
        self._adopted: dict[str, int] = {}
        self._gone: deque[str] = deque()  # indexed keys a read found missing (another process)
        self._seq = 0
        self._hits: deque[str] = deque()  # read hits not yet applied to the index (lock-free)
        self._buffers = ReadBuffers(max_idle_bytes=read_buffer_bytes)
        self._lost: str | None = None  # why the data file is not this tier's any more (ping)
        # A fixed 64 MiB on top: page-granular copy-on-write overhead and pages held by open
        # readers dominate small tiers. The file is sparse, so unused map costs nothing.
        map_size = int(capacity_bytes * (1 + map_headroom)) + (64 << 20)
        # An unreadable directory (corrupt, another LMDB version) is moved aside: a cache
        # that cannot be read must not keep the engine from starting (tiers.lmdb_files).
        open_or_move_aside(self.path, lambda: self._open(map_size, sync, writemap))
        warn_if_disk_smaller(self.path, capacity_bytes, self._file)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=writer_queue_size)
        self._closed = False
        self._writer = threading.Thread(
            target=self._write_loop, name=f"lmdb-writer:{self.path}", daemon=True
        )
        self._writer.start()
        lmdb_envs.register_tier(self.path, self)  # read views of this process use this tier

    @classmethod
    def from_config(cls, config: Any) -> LmdbTier:
        """Registry factory (``tiers.lmdb:LmdbTier.from_config``) for an ``LmdbTierConfig``."""
        extra = {}
        if getattr(config, "read_buffer_bytes", None) is not None:
            extra["read_buffer_bytes"] = config.read_buffer_bytes
        return cls(
            config.path,
            config.capacity,
            map_headroom=config.map_headroom,
            writer_queue_size=config.writer_queue_size,
            sync=config.sync,
            writemap=config.writemap,
            **extra,
        )

    def _open(self, map_size: int, sync: bool, writemap: bool) -> None:
        """Open the environment and its sub-databases and rebuild the index; on failure close
        what was opened (so the directory can be moved aside) and raise TierError."""
        import lmdb

        lmdb_envs.release_views(self.path)  # one environment per path and process
        with guard("open", self.path):
            self._env = lmdb.open(
                self.path,
                map_size=map_size,
                max_dbs=3,
                sync=sync,
                metasync=sync,
                readahead=False,
                writemap=writemap,
                max_readers=256,
            )
        data_file: DataFile | None = None
        try:
            self._psize = self._env.stat()["psize"]
            data_file = DataFile(self.path, map_size, self._psize)
            # Opening writes a few pages (new sub-databases, the byte count): with no disk
            # for them, open read-only instead; writes fail (DiskFull) until space is freed.
            try:
                data_file.reserve(self._high_water(), write_need([], 0, self._psize))
                room = True
            except DiskFull as exc:
                log.warning("%s; opened without writing", exc)
                room = False
            with guard("open", self.path):  # (a new sub-database is a write)
                self._blocks = self._env.open_db(b"blocks", create=room)
                self._recency = self._env.open_db(b"recency", create=room)
                self._meta = self._env.open_db(b"meta", create=room)  # USED
            self._rebuild_index(write=room)
        except BaseException:
            self._env.close()
            if data_file is not None:
                data_file.close()
            raise
        self._file = data_file

    def _high_water(self) -> int:
        """Bytes of the data file LMDB has used so far (exact inside a write transaction)."""
        return int(self._env.info()["last_pgno"] + 1) * self._psize

    def _rebuild_index(self, write: bool = True) -> None:
        """Reset the in-memory index from disk (at open, and after an aborted write).
        ``write``: store the directory's byte count if it is off (False: no disk to write)."""
        self._index.clear()
        self._dirty.clear()
        order: list[tuple[int, str]] = []
        sizes: dict[str, int] = {}
        # One write transaction, so no other process writes meanwhile: the byte count it
        # stores is the sum of the sizes read here, exact however the directory was written
        # before (an older kvtier kept no count).
        with guard("open", self.path), self._env.begin(write=write, buffers=True) as txn:
            for raw_key, raw_seq in txn.cursor(db=self._recency):
                order.append((SEQ.unpack(raw_seq)[0], bytes(raw_key).decode()))
            for raw_key, raw_value in txn.cursor(db=self._blocks):
                sizes[bytes(raw_key).decode()] = len(raw_value)
            used = sum(sizes.values())
            raw = txn.get(USED, db=self._meta)
            if write and (raw is None or SEQ.unpack(raw)[0] != used):
                txn.put(USED, SEQ.pack(used), db=self._meta)
        self._used_bytes = used
        # A block without a recency record (crash between the two puts cannot happen: both go
        # in one transaction; kept defensive) counts as least recently used.
        seen = {key for _, key in order}
        missing = [(-1, k) for k in sizes if k not in seen]
        for seq, key in sorted(missing + order):
            if key in sizes:
                self._index[key] = sizes[key]
                self._seq = max(self._seq, seq)

    # -- Tier protocol -------------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> int:
        """Leading keys held, from the in-memory index without the lock: the writer holds it
        for a whole write transaction, and a lookup on the engine's step path waited for it
        (up to 245 ms per request in the H200 QA run over a 2 GiB host tier). Stale by at most
        the write in progress: a key it evicts may still count, and its read then misses
        (that block and the rest are recomputed). Recency is refreshed through the hit queue,
        which the writer applies before it chooses what to evict."""
        self._refuse_if_lost()
        index, adopted = self._index, self._adopted
        n = 0
        for key in keys:
            if key not in index and key not in adopted:  # dict lookups: atomic under the GIL
                break
            n += 1
        if n < len(keys):  # another process may have written the rest: one read transaction
            n += self._adopt_from_disk(keys[n:])
        self._queue_hits(keys[:n])
        return n

    def _adopt_from_disk(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` the directory holds though this process's index does not
        (another process wrote them); they are answered from ``_adopted`` from now on."""
        n = 0
        with guard("lookup", self.path), self._env.begin(db=self._blocks, buffers=True) as txn:
            for key in keys:
                buf = txn.get(key.encode())
                if buf is None:
                    break
                self._adopted[key] = len(buf)
                n += 1
        return n

    def holds_hint(self, key: str) -> bool:
        """From memory without the lock (the writer holds it for a whole write transaction):
        dict lookups, atomic under the GIL, stale by at most that write (and by what another
        process wrote since this one last looked)."""
        return (key in self._index or key in self._adopted) and self._lost is None

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """From the in-memory index, then the directory for the keys it lacks (another
        process's writes, adopted into the index); recency is not refreshed."""
        self._refuse_if_lost()
        with self._lock:
            self._fold_adopted()
            out = [key in self._index for key in keys]
            absent = [i for i, here in enumerate(out) if not here]
            if absent:
                with (
                    guard("contains", self.path),
                    self._env.begin(db=self._blocks, buffers=True) as txn,
                ):
                    for i in absent:
                        buf = txn.get(keys[i].encode())
                        if buf is not None:
                            self._index[keys[i]] = len(buf)
                            out[i] = True
            return out

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        """Memoryviews into one recycled buffer per call (one copy out of the map), valid for
        as long as they are held. Takes no lock: never waits for the writer."""
        self._refuse_if_lost()
        encoded = [key.encode() for key in keys]
        out: list[Value | None] = [None] * len(keys)
        with guard("get", self.path), self._env.begin(db=self._blocks, buffers=True) as txn:
            found = [txn.get(k) for k in encoded]
            total = sum(len(b) for b in found if b is not None)
            dest = self._buffers.take(total)
            pos = 0
            for i, buf in enumerate(found):
                if buf is not None:
                    end = pos + len(buf)
                    copy_into(dest[pos:end], buf)
                    out[i] = dest[pos:end]
                    pos = end
            del found  # the map's buffers die with the transaction
        self._note_hits(keys, out)
        return out

    def get_many_into(self, keys: Sequence[str], out: Sequence[Any]) -> list[int | None]:
        """Straight from the map into ``out`` (see ``Tier.get_many_into``); no lock taken."""
        self._refuse_if_lost()
        views = writable_views(keys, out)
        lengths: list[int | None] = []
        with guard("get", self.path), self._env.begin(db=self._blocks, buffers=True) as txn:
            for key, view in zip(keys, views, strict=True):
                buf = txn.get(key.encode())
                if buf is None:
                    lengths.append(None)
                    continue
                if len(buf) <= view.nbytes:
                    copy_into(view, buf)
                lengths.append(len(buf))
        self._note_hits(keys, lengths)
        return lengths

    def _note_hits(self, keys: Sequence[str], found: Sequence[object]) -> None:
        """``_queue_hits`` of the keys whose value was found; indexed keys that were not (another
        process deleted them) leave the index at the next write."""
        self._queue_hits([k for k, v in zip(keys, found, strict=True) if v is not None])
        index, adopted = self._index, self._adopted
        self._gone.extend(
            k
            for k, v in zip(keys, found, strict=True)
            if v is None and (k in index or k in adopted)
        )

    def _queue_hits(self, keys: Sequence[str]) -> None:
        """Queue the keys' recency refresh; apply the queue here only if nobody holds the lock."""
        self._hits.extend(keys)
        if len(self._hits) > _DRAIN_AT and self._lock.acquire(blocking=False):
            try:
                self._apply_hits()
            finally:
                self._lock.release()

    def _fold_adopted(self) -> None:  # lock held
        """Keys ``lookup`` found on disk join the index (most recent: about to be read), and
        keys a read found gone leave it. Neither changes the directory's byte count."""
        for _ in range(len(self._adopted)):
            key, size = self._adopted.popitem()
            if key not in self._index:
                self._index[key] = size
        for _ in range(len(self._gone)):
            self._index.pop(self._gone.popleft(), None)

    def _apply_hits(self) -> None:  # lock held
        for _ in range(len(self._hits)):
            key = self._hits.popleft()  # only lock holders pop: never empty here
            if key in self._index:
                self._touch(key)

    def put_many(self, items: Sequence[tuple[str, Value]]) -> list[Evicted]:
        """Waits for the write transaction; returns the evicted entries with their bytes."""
        return self._submit(WriteOp(puts=items)).evicted if items else []

    def delete_many(self, keys: Sequence[str]) -> int:
        """Delete unpinned keys (waits for the write); pinned ones stay and are not counted."""
        return self._submit(WriteOp(deletes=keys)).num_deleted if keys else 0

    def usage(self) -> TierUsage:
        """The directory's bytes (every process's: read now) and this process's entries."""
        with self._lock:
            entries, used = len(self._index), self._used_bytes
        with guard("usage", self.path), self._env.begin(db=self._meta, buffers=True) as txn:
            raw = txn.get(USED)
            if raw is not None:
                used = SEQ.unpack(raw)[0]
        return TierUsage(used, self.capacity_bytes, entries)

    def ping(self) -> None:
        """The store's idle probe (``cachestore.store.prober``): TierError when the data file
        at ``path`` is no longer the one this tier has open (its directory was deleted or
        replaced while it ran: what it writes goes to an unlinked file, lost at exit). From
        then on every call raises it too, so the tier stays down in /health until the process
        is restarted, which opens the directory afresh."""
        if self._closed:
            raise TierError(f"lmdb tier at {self.path} is closed")
        self._refuse_if_lost()
        self._check_file()

    def close(self) -> None:
        """Finish queued writes, persist recency, close the environment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        lmdb_envs.unregister_tier(self.path, self)
        self._queue.put(STOP)
        self._writer.join()
        self._env.close()
        self._file.close()

    # -- pins ----------------------------------------------------------------------------

    # Pins take their own lock, not the writer's (held for a whole write transaction): the
    # engine pins a load's blocks on its step path. The writer reads ``_pins`` without it, so a
    # key pinned while a write transaction runs may still be evicted by that one write; the
    # load's read then misses there and the rest is recomputed.

    def pin(self, keys: Sequence[str]) -> int:
        """Pin the leading present keys; return how many (stops at the first absent key)."""
        with self._pin_lock:
            for i, key in enumerate(keys):
                if not self.holds_hint(key):
                    return i
                self._pins[key] = self._pins.get(key, 0) + 1
            return len(keys)

    def pin_each(self, keys: Sequence[str]) -> list[bool]:
        """Pin every present key, past an absent one too; True where pinned (see HostTier)."""
        out: list[bool] = []
        with self._pin_lock:
            for key in keys:
                here = self.holds_hint(key)
                if here:
                    self._pins[key] = self._pins.get(key, 0) + 1
                out.append(here)
        return out

    def unpin(self, keys: Sequence[str]) -> None:
        with self._pin_lock:
            for key in keys:
                n = self._pins.get(key, 0)
                if n > 1:
                    self._pins[key] = n - 1
                elif n == 1:
                    del self._pins[key]

    def lru_keys(self) -> list[str]:
        """Keys, least recently used first (tests, debugging)."""
        with self._lock:
            self._fold_adopted()
            self._apply_hits()
            return list(self._index)

    # -- writer --------------------------------------------------------------------------

    def _touch(self, key: str) -> None:  # lock held
        self._seq += 1
        self._index.move_to_end(key)
        self._dirty[key] = self._seq
