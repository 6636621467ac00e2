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
- Every ``lmdb.Error`` becomes ``TierError``. One process per ``path``: the index is per process.

Thread-safe.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiers.base import Evicted, Tier, TierUsage, Value, writable_views
from tiers.buffers import ReadBuffers, copy_into
from tiers.lmdb_writer import SEQ, STOP, LmdbWriter, WriteOp, guard

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
        writemap: bool = True,
    ) -> None:
        """Open (creating if needed) the environment and rebuild the LRU index.

        ``read_buffer_bytes``: idle read buffers ``get_many`` keeps for reuse (``tiers.buffers``).
        ``writemap``: the writer writes pages through the shared map instead of ``write(2)``
        calls (LMDB's ``MDB_WRITEMAP``). With 2 MiB values that is 2.3x (fresh file) to 8x
        (evictions freeing and reusing pages) the put rate on the 2-core CI machine, the rate
        a write-through tier must keep up with. The data file is then as large as the map
        (sparse: unwritten pages take no disk).
        Raises TierError when LMDB cannot open ``path``.
        """
        import lmdb

        self.path = str(path)
        self.capacity_bytes = capacity_bytes
        Path(self.path).mkdir(parents=True, exist_ok=True)
        # A fixed 64 MiB on top: page-granular copy-on-write overhead and pages held by open
        # readers dominate small tiers. The file is sparse, so unused map costs nothing.
        map_size = int(capacity_bytes * (1 + map_headroom)) + (64 << 20)
        with guard("open", self.path):
            self._env = lmdb.open(
                self.path,
                map_size=map_size,
                max_dbs=2,
                sync=sync,
                metasync=sync,
                readahead=False,
                writemap=writemap,
                max_readers=256,
            )
            self._blocks = self._env.open_db(b"blocks")
            self._recency = self._env.open_db(b"recency")
        self._lock = threading.Lock()  # guards the index, dirty recency and _seq (pins: _pin_lock)
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> nbytes, least recent first
        self._pins: dict[str, int] = {}
        self._pin_lock = threading.Lock()  # guards _pins' counts (see pin)
        self._dirty: dict[str, int] = {}  # key -> seq not yet written to ``recency``
        self._used_bytes = 0
        self._seq = 0
        self._hits: deque[str] = deque()  # read hits not yet applied to the index (lock-free)
        self._buffers = ReadBuffers(max_idle_bytes=read_buffer_bytes)
        self._rebuild_index()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=writer_queue_size)
        self._closed = False
        self._writer = threading.Thread(
            target=self._write_loop, name=f"lmdb-writer:{self.path}", daemon=True
        )
        self._writer.start()

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

    def _rebuild_index(self) -> None:
        """Reset the in-memory index from disk (at open, and after an aborted write)."""
        self._index.clear()
        self._dirty.clear()
        self._used_bytes = 0
        order: list[tuple[int, str]] = []
        sizes: dict[str, int] = {}
        with guard("open", self.path), self._env.begin(buffers=True) as txn:
            for raw_key, raw_seq in txn.cursor(db=self._recency):
                order.append((SEQ.unpack(raw_seq)[0], bytes(raw_key).decode()))
            for raw_key, raw_value in txn.cursor(db=self._blocks):
                sizes[bytes(raw_key).decode()] = len(raw_value)
        # A block without a recency record (crash between the two puts cannot happen: both go
        # in one transaction; kept defensive) counts as least recently used.
        seen = {key for _, key in order}
        missing = [(-1, k) for k in sizes if k not in seen]
        for seq, key in sorted(missing + order):
            if key in sizes:
                self._index[key] = sizes[key]
                self._used_bytes += sizes[key]
                self._seq = max(self._seq, seq)

    # -- Tier protocol -------------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> int:
        """Leading keys held, from the in-memory index without the lock: the writer holds it
        for a whole write transaction, and a lookup on the engine's step path waited for it
        (up to 245 ms per request in the H200 QA run over a 2 GiB host tier). Stale by at most
        the write in progress: a key it evicts may still count, and its read then misses
        (that block and the rest are recomputed). Recency is refreshed through the hit queue,
        which the writer applies before it chooses what to evict."""
        index = self._index
        n = 0
        for key in keys:
            if key not in index:  # one dict lookup: atomic under the GIL
                break
            n += 1
        self._queue_hits(keys[:n])
        return n

    def holds_hint(self, key: str) -> bool:
        """From the in-memory index without the lock (the writer holds it for a whole write
        transaction): one dict lookup, atomic under the GIL, stale by at most that write."""
        return key in self._index

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """From the in-memory index (committed entries only); recency is not refreshed."""
        with self._lock:
            return [key in self._index for key in keys]

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        """Memoryviews into one recycled buffer per call (one copy out of the map), valid for
        as long as they are held. Takes no lock: never waits for the writer."""
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
        """``_queue_hits`` of the keys whose value was found."""
        self._queue_hits([k for k, v in zip(keys, found, strict=True) if v is not None])

    def _queue_hits(self, keys: Sequence[str]) -> None:
        """Queue the keys' recency refresh; apply the queue here only if nobody holds the lock."""
        self._hits.extend(keys)
        if len(self._hits) > _DRAIN_AT and self._lock.acquire(blocking=False):
            try:
                self._apply_hits()
            finally:
                self._lock.release()

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
        with self._lock:
            return TierUsage(self._used_bytes, self.capacity_bytes, len(self._index))

    def close(self) -> None:
        """Finish queued writes, persist recency, close the environment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(STOP)
        self._writer.join()
        self._env.close()

    # -- pins ----------------------------------------------------------------------------

    # Pins take their own lock, not the writer's (held for a whole write transaction): the
    # engine pins a load's blocks on its step path. The writer reads ``_pins`` without it, so a
    # key pinned while a write transaction runs may still be evicted by that one write; the
    # load's read then misses there and the rest is recomputed.

    def pin(self, keys: Sequence[str]) -> int:
        """Pin the leading present keys; return how many (stops at the first absent key)."""
        with self._pin_lock:
            for i, key in enumerate(keys):
                if key not in self._index:
                    return i
                self._pins[key] = self._pins.get(key, 0) + 1
            return len(keys)

    def pin_each(self, keys: Sequence[str]) -> list[bool]:
        """Pin every present key, past an absent one too; True where pinned (see HostTier)."""
        out: list[bool] = []
        with self._pin_lock:
            for key in keys:
                if key in self._index:
                    self._pins[key] = self._pins.get(key, 0) + 1
                out.append(key in self._index)
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
            self._apply_hits()
            return list(self._index)

    # -- writer --------------------------------------------------------------------------

    def _touch(self, key: str) -> None:  # lock held
        self._seq += 1
        self._index.move_to_end(key)
        self._dirty[key] = self._seq
