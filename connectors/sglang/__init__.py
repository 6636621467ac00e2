"""kvtier as SGLang's HiCache storage backend (``--hicache-storage-backend dynamic``,
docs/sglang.md).

SGLang's ``StorageBackendFactory`` imports this package and builds ``KvtierHiCacheStorage``
(``"module_path": "connectors.sglang"``, ``"class_name": "KvtierHiCacheStorage"``).

- ``config``: SGLang's extra config -> ``SglangStorageConfig`` (the tier YAML of ``kvtier
  serve --kv-offload-config``, a path or inline). Torch-free, SGLang-free.
- ``keys``: the namespace (model, page size, layout, TP rank and size, MLA) and the mapping
  of SGLang's page hashes onto kvtier keys. Torch-free, SGLang-free.
- ``pages``: SGLang's host pool seen page by page, zero copy (its page pointers).
- ``stats``: counters and SGLang's per-call page metrics.
- ``storage``: the ``HiCacheStorage`` subclass; the only module importing SGLang.

Importing the package imports nothing; ``KvtierHiCacheStorage`` loads on first access, so the
rest of kvtier never needs SGLang.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvtierHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "KvtierHiCacheStorage":
        from connectors.sglang.storage import KvtierHiCacheStorage

        return KvtierHiCacheStorage
    raise AttributeError(f"module 'connectors.sglang' has no attribute {name!r}")
