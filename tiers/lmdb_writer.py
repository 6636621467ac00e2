"""The LMDB tier's single writer (``tiers.lmdb``): one thread applies every put and delete in
its own write transaction, under the tier's index lock, and hands the result (evictions, counts,
or the error) back to the waiting caller. Readers never take that lock (see ``tiers.lmdb``).
"""

from __future__ import annotations

import queue
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from tiers.base import Evicted, TierError, Value
from tiers.lmdb_files import DataFile, DataFileLost, DiskFull, write_need
from tiers.shared import backend_errors

SEQ = struct.Struct("<Q")
STOP = object()
USED = b"used_bytes"  # key in the ``meta`` sub-database: the directory's value bytes (u64 LE)


@dataclass(slots=True)
class WriteOp:
    puts: Sequence[tuple[str, Value]] = ()
    deletes: Sequence[str] = ()
    done: threading.Event = field(default_factory=threading.Event)
    evicted: list[Evicted] = field(default_factory=list)
    num_deleted: int = 0
    error: BaseException | None = None


def guard(op: str, path: str) -> AbstractContextManager[None]:
    import lmdb

    return backend_errors((lmdb.Error,), "lmdb", op, f"at {path}")


class LmdbWriter:
    """Mixin: the write half of ``LmdbTier``, which owns every attribute used here."""

    path: str
    capacity_bytes: int
    _env: Any
    _blocks: Any
    _recency: Any
    _meta: Any
    _lock: threading.Lock
    _index: OrderedDict[str, int]
    _pins: dict[str, int]
    _dirty: dict[str, int]
    _used_bytes: int
    _seq: int
    _queue: queue.Queue[Any]
    _closed: bool
    _file: DataFile
    _psize: int
    _lost: str | None
    _high_water: Callable[[], int]  # bytes of the data file LMDB has used (tiers.lmdb)
    _rebuild_index: Callable[[], None]  # reset the index from disk after an aborted write
    _apply_hits: Callable[[], None]  # fold queued read hits into the index (lock held)
    _fold_adopted: Callable[[], None]  # keys found on disk in, keys found gone out (lock held)

    def _submit(self, op: WriteOp) -> WriteOp:
        if self._closed:
            raise TierError(f"lmdb tier at {self.path} is closed")
        self._refuse_if_lost()
        self._queue.put(op)
        op.done.wait()
        if op.error is not None:
            raise op.error
        return op

    def _write_loop(self) -> None:
        while True:
            op = self._queue.get()
            if op is STOP:
                try:
                    self._apply(None)  # persist recency
                except TierError:
                    pass
                return
            try:
                self._apply(op)
            except BaseException as exc:  # handed to the waiting caller, never lost
                op.error = exc if isinstance(exc, TierError) else TierError(f"lmdb write: {exc}")
            finally:
                op.done.set()

    def _apply(self, op: WriteOp | None) -> None:
        """One write transaction: commits on success, aborts on error (then the in-memory
        index, which the transaction already changed, is rebuilt from disk to stay exact)."""
        with self._lock:
            self._fold_adopted()
            self._apply_hits()  # reads so far count before any eviction is chosen
            try:
                with guard("write", self.path), self._env.begin(write=True, buffers=True) as txn:
                    self._make_room(op)
                    # Several processes may write this directory (engines of one machine, the
                    # ranks of a tensor-parallel engine): the byte count is the directory's,
                    # kept in the same transactions as the blocks, so the capacity bounds
                    # everyone's blocks together.
                    raw = txn.get(USED, db=self._meta)
                    self._used_bytes = 0 if raw is None else SEQ.unpack(raw)[0]
                    before = self._used_bytes
                    for key, seq in self._dirty.items():
                        if key in self._index:
                            txn.put(key.encode(), SEQ.pack(seq), db=self._recency)
                    if op is not None:
                        for key in op.deletes:
                            if key in self._index and key not in self._pins:
                                op.num_deleted += self._delete(txn, key) > 0
                        for key, value in op.puts:
                            self._put_one(txn, key, memoryview(value).cast("B"), op)
                    if self._used_bytes != before or raw is None:
                        txn.put(USED, SEQ.pack(self._used_bytes), db=self._meta)
                self._dirty.clear()
            except (DiskFull, DataFileLost):
                raise  # raised before anything was written: the index is still exact
            except BaseException:
                self._rebuild_index()
                raise

    def _make_room(self, op: WriteOp | None) -> None:  # lock held, a write transaction open
        """Before the transaction writes anything (``op`` None: recency only): DataFileLost
        (``_check_file``) when the data file at ``path`` is not the one open, DiskFull when the
        disk has no blocks for what the transaction may add to the file (with ``writemap`` the
        write would be a SIGBUS: ``tiers.lmdb_files``)."""
        self._check_file()
        sizes = [memoryview(v).nbytes for _, v in op.puts] if op is not None else []
        others = len(self._dirty) + (len(op.deletes) if op is not None else 0)
        self._file.reserve(self._high_water(), write_need(sizes, others, self._psize))

    def _check_file(self) -> None:
        """DataFileLost when the data file at ``path`` is no longer the one open (deleted or
        replaced: what the tier writes would be lost); the tier refuses every call from then
        on (``_refuse_if_lost``), until a restart opens the directory afresh."""
        try:
            self._file.check_same()
        except DataFileLost as exc:
            self._lost = str(exc)
            raise

    def _refuse_if_lost(self) -> None:
        """TierError once the data file was found gone (``_check_file``)."""
        if self._lost is not None:
            raise TierError(self._lost)

    def _put_one(self, txn: Any, key: str, value: memoryview, op: WriteOp) -> None:
        # Lock held, inside the write transaction. Victims are this process's least recent
        # entries (those of another process it has looked up count as its own); one another
        # process already deleted is dropped from the index and frees nothing.
        if value.nbytes > self.capacity_bytes:
            return
        held = txn.get(key.encode(), db=self._blocks)
        old = 0 if held is None else len(held)
        room = self.capacity_bytes - self._used_bytes + old
        victims: dict[str, bytes] = {}
        room = self._choose_victims(txn, key, value.nbytes, room, victims)
        # Out of victims of its own while the directory is full of blocks another process
        # wrote since this one opened: take them in as the least recent, once.
        if room < value.nbytes and self._adopt_all(txn):
            room = self._choose_victims(txn, key, value.nbytes, room, victims)
        if room < value.nbytes:
            return  # everything else is pinned or another process's: skip, keep any old copy
        for victim, raw in victims.items():
            op.evicted.append(Evicted(victim, raw))
            self._delete(txn, victim)
        self._seq += 1
        txn.put(key.encode(), value, db=self._blocks)
        txn.put(key.encode(), SEQ.pack(self._seq), db=self._recency)
        self._index.pop(key, None)
        self._index[key] = value.nbytes
        self._used_bytes += value.nbytes - old

    def _choose_victims(
        self, txn: Any, key: str, need: int, room: int, victims: dict[str, bytes]
    ) -> int:  # lock held, inside the write transaction
        """Add the least recent unpinned entries (not ``key``, not already chosen) to
        ``victims`` with their bytes until ``room`` reaches ``need``; entries another process
        already deleted leave the index. Returns the room then."""
        gone: list[str] = []
        for victim in self._index:
            if room >= need:
                break
            if victim == key or victim in self._pins or victim in victims:
                continue
            raw = txn.get(victim.encode(), db=self._blocks)
            if raw is None:
                gone.append(victim)
                continue
            victims[victim] = bytes(raw)  # before any write: a buffer dies with it
            room += len(raw)
        for victim in gone:
            del self._index[victim]
        return room

    def _adopt_all(self, txn: Any) -> bool:  # lock held, inside the write transaction
        """Put every block the directory holds that the index lacks at its least recent end;
        whether there was any."""
        added = False
        for raw_key, raw in txn.cursor(db=self._blocks):
            key = bytes(raw_key).decode()
            if key not in self._index:
                self._index[key] = len(raw)
                self._index.move_to_end(key, last=False)
                added = True
        return added

    def _delete(self, txn: Any, key: str) -> int:  # lock held
        """Delete ``key`` here and from the index; the bytes it freed (0: already gone)."""
        self._index.pop(key, None)
        raw = txn.get(key.encode(), db=self._blocks)
        if raw is None:
            return 0
        size = len(raw)
        txn.delete(key.encode(), db=self._blocks)
        txn.delete(key.encode(), db=self._recency)
        self._used_bytes -= size
        return size
