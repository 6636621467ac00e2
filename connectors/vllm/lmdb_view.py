"""A read-only view of another process's LMDB tier, for lookups. Torch-free.

vLLM's scheduler runs in the engine-core process while the worker process owns the store and
its ``LmdbTier`` (one writer per path; its LRU index lives in that process). The scheduler asks
the same environment, opened ``readonly`` (LMDB's lock file lets readers of other processes run
beside the writer): a key is present when a read transaction begun now finds it in the
``blocks`` sub-database, so a block the worker committed a moment ago is seen.

The environment is opened on first use (the worker may create it after this view is built);
until it exists every lookup answers 0. Writes are refused (``TierError``); recency is not
refreshed (the worker's reads do that). ``lmdb.Error`` becomes ``TierError``. Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiers.base import Evicted, Tier, TierError, TierUsage, Value
from tiers.shared import backend_errors


class LmdbReadView(Tier):
    name = "lmdb"

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._env: Any = None
        self._blocks: Any = None
        self._lock = threading.Lock()
        self._closed = False

    def _open(self) -> bool:
        """Open the environment if it exists now; True when open."""
        if self._env is not None:
            return True
        import lmdb

        if not (Path(self.path) / "data.mdb").exists():
            return False
        with (
            self._lock,
            backend_errors((lmdb.Error,), "lmdb", "open", f"at {self.path}", closed=self._closed),
        ):
            if self._env is None:
                env = lmdb.open(
                    self.path, readonly=True, lock=True, max_dbs=2, readahead=False, create=False
                )
                self._blocks = env.open_db(b"blocks", create=False)
                self._env = env
        return True

    def _keys_present(self, keys: Sequence[str], stop_at_miss: bool) -> list[bool]:
        import lmdb

        if not keys or not self._open():
            return [False] * len(keys)
        out: list[bool] = []
        with (
            backend_errors((lmdb.Error,), "lmdb", "lookup", f"at {self.path}", closed=self._closed),
            self._env.begin(db=self._blocks, buffers=True) as txn,
        ):
            for key in keys:
                present = txn.get(key.encode()) is not None
                out.append(present)
                if stop_at_miss and not present:
                    break
        return out + [False] * (len(keys) - len(out))

    def lookup(self, keys: Sequence[str]) -> int:
        flags = self._keys_present(keys, stop_at_miss=True)
        return next((i for i, f in enumerate(flags) if not f), len(keys))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return self._keys_present(keys, stop_at_miss=False)

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        import lmdb

        if not self._open():
            return [None] * len(keys)
        with (
            backend_errors((lmdb.Error,), "lmdb", "get", f"at {self.path}", closed=self._closed),
            self._env.begin(db=self._blocks, buffers=True) as txn,
        ):
            return [None if (b := txn.get(k.encode())) is None else bytes(b) for k in keys]

    def put_many(self, items: Sequence[tuple[str, Value]]) -> list[Evicted]:
        raise TierError(f"lmdb view at {self.path} is read-only")

    def delete_many(self, keys: Sequence[str]) -> int:
        raise TierError(f"lmdb view at {self.path} is read-only")

    def usage(self) -> TierUsage:
        return TierUsage(0, None, 0)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._env is not None:
                self._env.close()
                self._env = None
