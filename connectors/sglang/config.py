"""The SGLang storage backend's configuration, from ``--hicache-storage-backend-extra-config``.
Torch-free, SGLang-free.

SGLang loads the backend with ``--hicache-storage-backend dynamic`` and an extra config naming
it (``backend_name``, ``module_path``, ``class_name``: SGLang's own keys, read by its
``StorageBackendFactory``). Beside them, the tier stack is the YAML of ``kvtier serve
--kv-offload-config`` (``connectors.offload.config``), a path or inline::

    {"backend_name": "kvtier", "module_path": "connectors.sglang",
     "class_name": "KvtierHiCacheStorage", "interface_v1": 1,
     "kvtier_config": "/etc/kvtier/tiers.yaml"}
    {..., "kvtier_config": {"tiers": [...]}}
    {..., "tiers": [...]}                       # the same, flattened

and the backend's own keys: ``model_fingerprint`` (the namespace's model identity; default:
SGLang's model name), ``staging_bytes`` (the per-thread read buffer, default 64 MiB; at least
one page is always read) and ``stats_file`` (a JSON file rewritten at close with the
counters and the store's per-tier stats).

Of the offload YAML the backend uses ``tiers`` (host, lmdb, redis, s3, remote, with their
write policies), ``drain_timeout_s`` and ``health_probe_s``; the engine-only knobs
(``decision``, ``calibrate``, ...) are accepted and ignored: SGLang decides what to prefetch.
``compression: lossless`` is refused (pages are stored raw). Errors are ``ConfigError``
naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from connectors.offload.config import OffloadConfig, load_offload_config
from tiers.config import ConfigError

# SGLang's own keys in the same dict (its factory and cache controller read them).
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size")
OWN_KEYS = ("kvtier_config", "model_fingerprint", "staging_bytes", "stats_file")
DEFAULT_STAGING_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class SglangStorageConfig:
    offload: OffloadConfig
    model_fingerprint: str | None = None  # None: SGLang's model name
    staging_bytes: int = DEFAULT_STAGING_BYTES
    stats_file: str | None = None


def parse_storage_config(extra: Mapping[str, Any] | None) -> SglangStorageConfig:
    """SGLang's ``extra_config`` -> SglangStorageConfig. Raises ConfigError (one line)."""
    extra = {k: v for k, v in dict(extra or {}).items() if k not in SGLANG_KEYS}
    own = {k: extra.pop(k) for k in OWN_KEYS if k in extra}
    source = own.pop("kvtier_config", None)
    if source is None:
        if "tiers" not in extra:
            raise ConfigError(
                "kvtier SGLang backend: the extra config needs 'kvtier_config' "
                "(a tier YAML path or mapping) or inline 'tiers'"
            )
        source = extra
    elif extra:
        raise ConfigError(
            f"kvtier SGLang backend: unknown key(s) {sorted(extra)} beside "
            f"'kvtier_config'; known: {list(OWN_KEYS + SGLANG_KEYS)}"
        )
    if not isinstance(source, (str, Mapping)):
        raise ConfigError(
            f"kvtier SGLang backend: 'kvtier_config' must be a path or a mapping, got {source!r}"
        )
    offload = load_offload_config(source)
    if offload.compression != "none":
        raise ConfigError("kvtier SGLang backend: compression must be 'none' (raw pages)")
    fingerprint = own.get("model_fingerprint")
    if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint):
        raise ConfigError(
            f"kvtier SGLang backend: model_fingerprint must be a non-empty "
            f"string, got {fingerprint!r}"
        )
    staging = own.get("staging_bytes", DEFAULT_STAGING_BYTES)
    if isinstance(staging, bool) or not isinstance(staging, int) or staging <= 0:
        raise ConfigError(
            f"kvtier SGLang backend: staging_bytes must be a positive integer, got {staging!r}"
        )
    stats_file = own.get("stats_file")
    if stats_file is not None and (not isinstance(stats_file, str) or not stats_file):
        raise ConfigError(f"kvtier SGLang backend: stats_file must be a path, got {stats_file!r}")
    return SglangStorageConfig(offload, fingerprint, staging, stats_file)
