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
from tiers.shared import backend_errors

SEQ = struct.Struct("<Q")
STOP = object()


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
    _lock: threading.Lock
    _index: OrderedDict[str, int]
    _pins: dict[str, int]
    _dirty: dict[str, int]
    _used_bytes: int
    _seq: int
    _queue: queue.Queue[Any]
    _closed: bool
    _rebuild_index: Callable[[], None]  # reset the index from disk after an aborted write
    _apply_hits: Callable[[], None]  # fold queued read hits into the index (lock held)

    def _submit(self, op: WriteOp) -> WriteOp:
        if self._closed:
            raise TierError(f"lmdb tier at {self.path} is closed")
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
            self._apply_hits()  # reads so far count before any eviction is chosen
            try:
                with guard("write", self.path), self._env.begin(write=True) as txn:
                    for key, seq in self._dirty.items():
                        if key in self._index:
                            txn.put(key.encode(), SEQ.pack(seq), db=self._recency)
                    if op is not None:
                        for key in op.deletes:
                            if key in self._index and key not in self._pins:
                                self._delete(txn, key)
                                op.num_deleted += 1
                        for key, value in op.puts:
                            self._put_one(txn, key, memoryview(value).cast("B"), op)
                self._dirty.clear()
            except BaseException:
                self._rebuild_index()
                raise

    def _put_one(self, txn: Any, key: str, value: memoryview, op: WriteOp) -> None:
        # Lock held, inside the write transaction.
        if value.nbytes > self.capacity_bytes:
            return
        old = self._index.get(key)
        room = self.capacity_bytes - self._used_bytes + (old or 0)
        victims: list[str] = []
        for victim in self._index:
            if room >= value.nbytes:
                break
            if victim != key and victim not in self._pins:
                victims.append(victim)
                room += self._index[victim]
        if room < value.nbytes:
            return  # everything else is pinned: skip, keep any old copy
        for victim in victims:
            raw = txn.get(victim.encode(), db=self._blocks)
            op.evicted.append(Evicted(victim, None if raw is None else bytes(raw)))
            self._delete(txn, victim)
        if old is not None:
            self._used_bytes -= self._index.pop(key)
        self._seq += 1
        txn.put(key.encode(), value, db=self._blocks)
        txn.put(key.encode(), SEQ.pack(self._seq), db=self._recency)
        self._index[key] = value.nbytes
        self._used_bytes += value.nbytes

    def _delete(self, txn: Any, key: str) -> None:  # lock held
        txn.delete(key.encode(), db=self._blocks)
        txn.delete(key.encode(), db=self._recency)
        self._used_bytes -= self._index.pop(key)
