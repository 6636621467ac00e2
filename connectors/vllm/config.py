"""The vLLM connector's configuration, from ``kv_connector_extra_config``. Torch-free.

The tier stack is the YAML of ``kvtier serve --kv-offload-config``
(``connectors.offload.config``), given either as a file path or inline::

    "kv_connector_extra_config": {"kvtier_config": "/etc/kvtier/tiers.yaml"}
    "kv_connector_extra_config": {"kvtier_config": {"tiers": [...], "decision": "cost"}}
    "kv_connector_extra_config": {"tiers": [...], "decision": "cost"}   # the same, flattened

Beside it, the connector's own keys: ``stats_file`` (a JSON file the worker side rewrites with
its counters and the store's per-tier stats at every ``stats_interval_s`` and at shutdown) and
``cost_profile`` (the cost model's priors: ``cpu`` or ``h200-llama-3-8b``; default by platform).

Of the offload YAML's knobs the connector uses ``tiers``, ``decision`` (``cost``, ``load``,
``recompute``; ``overlap`` is refused: vLLM loads only a prefix), ``drain_timeout_s`` and
``health_probe_s`` (the worker store's idle-tier pings); the
engine-only ones (``calibrate``, ``in_step_host_loads``, ``layered_loads``, ...) are accepted
and ignored, and ``compression: lossless`` is refused (raw blocks only). The scheduler looks
blocks up in the tiers below the host tier (the host tier lives in the worker process), so a
stack needs at least one tier that is not ``host``. Errors are ``ConfigError`` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from connectors.offload.config import OffloadConfig, load_offload_config, warn_lmcache_settings
from tiers.config import ConfigError, HostTierConfig

CONNECTOR_KEYS = ("kvtier_config", "stats_file", "stats_interval_s", "cost_profile")
COST_PROFILES = ("cpu", "h200-llama-3-8b")
DECISIONS = ("cost", "load", "recompute")


@dataclass(frozen=True, slots=True)
class VllmConnectorConfig:
    offload: OffloadConfig
    stats_file: str | None = None
    stats_interval_s: float = 10.0
    cost_profile: str | None = None  # None: cpu on a CPU platform, else h200-llama-3-8b

    @property
    def decision(self) -> str:
        return self.offload.decision

    @property
    def has_host_tier(self) -> bool:
        return isinstance(self.offload.tiers.tiers[0], HostTierConfig)


def parse_connector_config(extra: Mapping[str, Any] | None) -> VllmConnectorConfig:
    """``kv_connector_extra_config`` -> VllmConnectorConfig. Raises ConfigError."""
    extra = dict(extra or {})
    source = extra.pop("kvtier_config", None)
    own = {k: extra.pop(k) for k in CONNECTOR_KEYS if k in extra}
    if source is None:
        if not extra:
            raise ConfigError(
                "kvtier vLLM connector: kv_connector_extra_config needs "
                "'kvtier_config' (a tier YAML path or mapping) or inline 'tiers'"
            )
        source = extra
    elif extra:
        raise ConfigError(
            f"kvtier vLLM connector: unknown key(s) {sorted(extra)} beside "
            f"'kvtier_config'; known: {list(CONNECTOR_KEYS)}"
        )
    if not isinstance(source, (str, Mapping)):
        raise ConfigError(
            f"kvtier vLLM connector: 'kvtier_config' must be a path or a mapping, got {source!r}"
        )
    offload = load_offload_config(source)
    warn_lmcache_settings()
    if offload.decision not in DECISIONS:
        raise ConfigError(
            f"kvtier vLLM connector: decision {offload.decision!r}; choose one of "
            f"{DECISIONS} (vLLM loads a prefix only)"
        )
    if offload.compression != "none":
        raise ConfigError("kvtier vLLM connector: compression must be 'none' (raw blocks)")
    if all(isinstance(t, HostTierConfig) for t in offload.tiers.tiers):
        raise ConfigError(
            "kvtier vLLM connector: the tier stack needs a tier below 'host' "
            "(vLLM's scheduler process looks blocks up there)"
        )
    profile = own.get("cost_profile")
    if profile is not None and profile not in COST_PROFILES:
        raise ConfigError(
            f"kvtier vLLM connector: cost_profile {profile!r}; choose one of {COST_PROFILES}"
        )
    stats_file = own.get("stats_file")
    if stats_file is not None and (not isinstance(stats_file, str) or not stats_file):
        raise ConfigError(f"kvtier vLLM connector: stats_file must be a path, got {stats_file!r}")
    interval = own.get("stats_interval_s", 10.0)
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0:
        raise ConfigError(f"kvtier vLLM connector: stats_interval_s must be > 0, got {interval!r}")
    return VllmConnectorConfig(offload, stats_file, float(interval), profile)
