"""kvtier as a vLLM KV connector (``--kv-transfer-config``, docs/vllm.md).

vLLM loads ``KvtierConnector`` from this package (``"kv_connector_module_path":
"connectors.vllm"``) and builds it twice: scheduler side in the engine-core process, worker side
in each worker process.

- ``config``: ``kv_connector_extra_config`` -> ``VllmConnectorConfig`` (the tier YAML of
  ``kvtier serve --kv-offload-config``, a path or inline).
- ``keys``: the namespace (model fingerprint, dtype, block size, layout, TP rank/size) and each
  request's chained block keys, from its token ids.
- ``lookup``: the scheduler's view of the tiers (every tier below the worker's host tier; LMDB
  opened read-only: ``lmdb_view``).
- ``scheduler``: lookups, the reload-versus-recompute decision, the per-step load/save jobs
  (``metadata``). Torch-free and vLLM-free.
- ``worker``: the per-layer KV tensors, loads before the forward, saves of full blocks (off
  the forward path), failures reported as load errors. Torch, no vLLM.
- ``stats``: counters; ``connector`` and ``metrics``: the only modules importing vLLM.

Importing the package imports nothing; ``KvtierConnector`` (and the vLLM classes around it)
load on first access, so the rest of kvtier never needs vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvtierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvtierConnector":
        from connectors.vllm.connector import KvtierConnector

        return KvtierConnector
    raise AttributeError(f"module 'connectors.vllm' has no attribute {name!r}")
