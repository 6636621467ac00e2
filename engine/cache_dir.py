"""kvtier's one cache directory: converted models, the default LMDB tier, CPU kernels."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$KVTIER_CACHE_DIR``, else ``~/.cache/kvtier`` (``HOME`` from ``env``: the process
    environment unless given)."""
    env = os.environ if env is None else env
    explicit = env.get("KVTIER_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(env.get("HOME") or Path.home()) / ".cache" / "kvtier"
