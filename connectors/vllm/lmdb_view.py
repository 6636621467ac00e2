"""A read-only view of another process's LMDB tier, for lookups. Torch-free.

vLLM's scheduler runs in the engine-core process while the worker process owns the store and
its ``LmdbTier`` (one writer per path; its LRU index lives in that process). The scheduler asks
the same environment, opened ``readonly`` (LMDB's lock file lets readers of other processes run
beside the writer): a key is present when a read transaction begun now finds it in the
``blocks`` sub-database, so a block the worker committed a moment ago is seen.

The environment is opened on first use (the worker may create it after this view is built);
until it exists every lookup answers 0. Where the worker's ``LmdbTier`` is open in this very
process (one GPU: vLLM's uni executor runs the worker inside the engine core), the view asks
that tier instead: LMDB allows one environment per path and process (``tiers.lmdb_envs``).
Writes are refused (``TierError``); recency is not refreshed (the worker's reads do that;
through a tier of this process a ``get_many`` refreshes it). ``lmdb.Error`` becomes
``TierError``. Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tiers import lmdb_envs
from tiers.base import Evicted, Tier, TierError, TierUsage, Value
from tiers.shared import backend_errors


class LmdbReadView(Tier):
    name = "lmdb"

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._env: Any = None
        self._blocks: Any = None
        self._lock = threading.Lock()  # guards the own environment, its opening and its reads
        self._closed = False

    def _tier(self) -> Any | None:
        """The ``LmdbTier`` this process has open at ``path`` (vLLM's worker inside the engine
        core: the uni executor), or None. LMDB allows one environment per path and process,
        so the view reads through that tier instead of opening one (``tiers.lmdb_envs``)."""
        tier = lmdb_envs.tier_at(self.path)
        return tier if tier is not None and not self._closed else None

    def _open(self) -> bool:
        """Open the environment if it exists now; True when open. Called under ``_lock``."""
        if self._env is not None:
            return True
        import lmdb

        if not (Path(self.path) / "data.mdb").exists():
            return False
        with backend_errors((lmdb.Error,), "lmdb", "open", f"at {self.path}", closed=self._closed):
            env = lmdb.open(
                self.path, readonly=True, lock=True, max_dbs=2, readahead=False, create=False
            )
            try:
                self._blocks = env.open_db(b"blocks", create=False)
            except BaseException:
                env.close()
                raise
            self._env = env
        lmdb_envs.add_release(self.path, id(self), self._release)
        return True

    def _release(self) -> None:
        """An ``LmdbTier`` of this process is opening ``path``: close the own environment
        (later reads go through that tier)."""
        with self._lock:
            if self._env is not None:
                self._env.close()
                self._env = self._blocks = None

    def _read(self, op: str, read: Callable[[Any], list[Any]], missing: list[Any]) -> list[Any]:
        """``read(txn)`` in a read transaction of the own environment, under ``_lock``;
        ``missing`` while the environment does not exist yet. ``lmdb.Error`` -> ``TierError``."""
        import lmdb

        with self._lock:
            if not self._open():
                return missing
            with (
                backend_errors((lmdb.Error,), "lmdb", op, f"at {self.path}", closed=self._closed),
                self._env.begin(db=self._blocks, buffers=True) as txn,
            ):
                return read(txn)

    def _keys_present(self, keys: Sequence[str], stop_at_miss: bool) -> list[bool]:
        if not keys:
            return []

        def read(txn: Any) -> list[bool]:
            out: list[bool] = []
            for key in keys:
                out.append(txn.get(key.encode()) is not None)
                if stop_at_miss and not out[-1]:
                    break
            return out

        out = self._read("lookup", read, [])
        return out + [False] * (len(keys) - len(out))

    def lookup(self, keys: Sequence[str]) -> int:
        tier = self._tier()
        if tier is not None:
            return int(tier.lookup(keys))
        flags = self._keys_present(keys, stop_at_miss=True)
        return next((i for i, f in enumerate(flags) if not f), len(keys))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        tier = self._tier()
        if tier is not None:
            return list(tier.contains_many(keys))
        return self._keys_present(keys, stop_at_miss=False)

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        tier = self._tier()
        if tier is not None:
            return [None if v is None else bytes(v) for v in tier.get_many(keys)]
        return self._read(
            "get",
            lambda txn: [None if (b := txn.get(k.encode())) is None else bytes(b) for k in keys],
            [None] * len(keys),
        )

    def put_many(self, items: Sequence[tuple[str, Value]]) -> list[Evicted]:
        raise TierError(f"lmdb view at {self.path} is read-only")

    def delete_many(self, keys: Sequence[str]) -> int:
        raise TierError(f"lmdb view at {self.path} is read-only")

    def usage(self) -> TierUsage:
        return TierUsage(0, None, 0)

    def close(self) -> None:
        lmdb_envs.remove_release(self.path, id(self))
        with self._lock:
            self._closed = True
            if self._env is not None:
                self._env.close()
                self._env = self._blocks = None
