"""The tier stack as configured: one YAML file (or the same dict) -> frozen per-kind configs.

Example::

    tiers:
      - {kind: host, capacity: 4GiB}
      - {kind: lmdb, path: /var/cache/kvtier, capacity: 100GiB}
      - {kind: redis, url: "redis://cache:6379/0", ttl_s: 3600, capacity: 64GiB}
      - {kind: s3, bucket: kv, endpoint_url: "http://minio:9000", prefix: kv/, blocks_per_object: 16}
      - {kind: remote, url: "tcp://cache-server:7000", token: secret}

Order is the hierarchy: the first tier is the top (fastest). Every field name is the YAML name;
sizes are ``parse_size`` strings with a unit (``4GiB``, ``100GB``; a bare number is refused):
the one size grammar, ``parse_quantity`` below, is also every CLI flag's and ``kvtier analyze``'s.

Per-kind fields, read-path knobs and write policies: ``tiers.config_kinds`` (re-exported here).
Errors raise ConfigError naming the tier and the field. Building tiers is ``tiers.build_tiers`` (the registry, so optional backends load only
when chosen); each kind has one config class, which its backend takes as is; this module
imports no backend (the registry and the backends import it).
Parsing is pure; the I/O is reading the file in ``load_tier_config`` (its errors name the file)
and ``check_resources`` at start (``tiers.build_tiers`` calls it first): a host tier larger than the
memory available (/proc/meminfo MemAvailable), or an LMDB path that cannot be a directory this
process writes, is a ConfigError naming the tier and the field, before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tiers.config_fields import (
    STORE_FIELDS,
    WRITE_BACK,
    WRITE_POLICIES,
    WRITE_THROUGH,
    WRITE_THROUGH_SELECTIVE,
    ConfigError,
)
from tiers.config_kinds import (
    CONFIG_CLASSES,
    REDIS_CLUSTER_SCHEMES,
    REDIS_MAX_BULK_BYTES,
    HostTierConfig,
    LmdbTierConfig,
    RedisTierConfig,
    RemoteTierConfig,
    S3TierConfig,
    TierConfig,
    redact_url,
)
from tiers.sizes import (
    BLOCKS,
    BYTES,
    TOKENS,
    UNBOUNDED,
    Size,
    approx_size,
    format_size,
    parse_quantity,
    parse_size,
)

# The tier config API: this module's own names and the field vocabulary and sizes it re-exports.
__all__ = [
    "BLOCKS",
    "BYTES",
    "CONFIG_CLASSES",
    "REDIS_CLUSTER_SCHEMES",
    "REDIS_MAX_BULK_BYTES",
    "STORE_FIELDS",
    "TOKENS",
    "UNBOUNDED",
    "WRITE_BACK",
    "WRITE_POLICIES",
    "WRITE_THROUGH",
    "WRITE_THROUGH_SELECTIVE",
    "ConfigError",
    "HostTierConfig",
    "LmdbTierConfig",
    "RedisTierConfig",
    "RemoteTierConfig",
    "S3TierConfig",
    "Size",
    "TierConfig",
    "TierStackConfig",
    "check_resources",
    "format_size",
    "process_share",
    "load_config_file",
    "load_tier_config",
    "mem_available_bytes",
    "parse_quantity",
    "parse_size",
    "parse_tier_config",
    "parse_tier_entry",
    "redact_url",
]


@dataclass(frozen=True, slots=True)
class TierStackConfig:
    tiers: tuple[TierConfig, ...]


def parse_tier_entry(entry: object, where: str = "tier") -> TierConfig:
    """One ``{kind: ..., ...}`` mapping -> its frozen config. Raises ConfigError."""
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: expected a mapping with a 'kind' field, got {entry!r}")
    kind = entry.get("kind")
    if kind is None:
        raise ConfigError(f"{where}: missing field 'kind' (one of {sorted(CONFIG_CLASSES)})")
    cls = CONFIG_CLASSES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ConfigError(f"{where}: unknown kind {kind!r}; choose one of {sorted(CONFIG_CLASSES)}")
    where = f"{where} ({kind})"
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in entry if k != "kind" and k not in known)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
    kwargs: dict[str, Any] = {}
    for name, f in known.items():
        if name not in entry or entry[name] is None:
            if f.default is dataclasses.MISSING or f.metadata["required"]:
                raise ConfigError(f"{where}: missing required field '{name}'")
            continue
        try:
            kwargs[name] = f.metadata["parse"](entry[name])
        except ValueError as exc:
            raise ConfigError(f"{where}: field '{name}': {exc}") from None
    try:
        return cls(**kwargs)  # type: ignore[no-any-return]
    except ValueError as exc:  # a check across fields (__post_init__)
        raise ConfigError(f"{where}: {exc}") from None


def parse_tier_config(data: object) -> TierStackConfig:
    """``{"tiers": [...]}`` -> TierStackConfig. Raises ConfigError on anything invalid."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"tier config must be a mapping with a 'tiers' list, got {data!r}")
    extra = sorted(str(k) for k in data if k != "tiers")
    if extra:
        raise ConfigError(f"tier config: unknown top-level field(s) {extra}; only 'tiers'")
    entries = data.get("tiers")
    if not isinstance(entries, list):
        raise ConfigError("tier config: field 'tiers' must be a list of tier mappings")
    if not entries:
        raise ConfigError("tier config: field 'tiers' is empty; configure at least one tier")
    tiers = tuple(parse_tier_entry(e, f"tiers[{i}]") for i, e in enumerate(entries))
    if any(isinstance(t, HostTierConfig) for t in tiers[1:]):
        raise ConfigError("tier config: a 'host' tier may only be the first (top) tier")
    return TierStackConfig(tiers=tiers)


T = TypeVar("T")


def load_config_file(path: str | os.PathLike[str], parse: Callable[[Any], T]) -> T:
    """``parse`` of the YAML document in ``path``. Raises ConfigError naming the file: one
    line for unreadable or invalid YAML (``tiers.yaml_file``), ``parse``'s ConfigError with the
    file in front (its message names only the tier and the field)."""
    from tiers.yaml_file import read_yaml

    try:
        data = read_yaml(path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        return parse(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def load_tier_config(path: str | Path) -> TierStackConfig:
    """Read and parse a YAML tier file (``load_config_file``)."""
    return load_config_file(path, parse_tier_config)


_FALLBACK_MEM_AVAILABLE = 4 << 30  # /proc/meminfo unreadable (not Linux)


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int:
    """MemAvailable from /proc/meminfo (4 GiB if unreadable). The one place it is read."""
    try:
        with open(meminfo, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return _FALLBACK_MEM_AVAILABLE


def process_share(config: TierStackConfig, processes: int) -> TierStackConfig:
    """``config`` as one of ``processes`` processes of one machine that split it between them
    (the ranks of a tensor-parallel engine, each storing its own head slice of every block):
    the host tier, which each process allocates for itself, gets ``1/processes`` of its
    ``capacity``; its slices being that much smaller, it holds as many blocks as the whole
    capacity at one process, and the machine holds what the file says, not ``processes``
    times it. The other tiers are unchanged: an LMDB directory counts every process's bytes
    against its one capacity (``tiers.lmdb``), and Redis, S3 and the cache server are bounded
    by their server."""
    if processes <= 1:
        return config
    tiers = tuple(
        dataclasses.replace(cfg, capacity=cfg.capacity // processes)
        if isinstance(cfg, HostTierConfig)
        else cfg
        for cfg in config.tiers
    )
    return TierStackConfig(tiers=tiers)


def check_resources(
    config: TierStackConfig,
    *,
    mem_available: int | None = None,
    source: str | os.PathLike[str] | None = None,
) -> None:
    """Start-time checks of what the stack needs from this machine; raises ConfigError naming
    the file ``source`` (the YAML the stack came from, when given), the tier and the field.
    Host tier: ``capacity`` at most ``mem_available`` (default: read MemAvailable now; a larger
    one would fail deep in the allocator, or start and swap). LMDB: ``path`` is made (as the
    tier would) and must take a file. Mutates: may create the LMDB directories."""
    for i, cfg in enumerate(config.tiers):
        where = f"{source}: tiers[{i}] ({cfg.kind})" if source else f"tiers[{i}] ({cfg.kind})"
        if isinstance(cfg, HostTierConfig):
            mem = mem_available_bytes() if mem_available is None else mem_available
            if cfg.capacity > mem:
                raise ConfigError(
                    f"{where}: field 'capacity': {approx_size(cfg.capacity)} is more than the memory "
                    f"available on this machine ({approx_size(mem)}, /proc/meminfo MemAvailable)"
                )
        elif isinstance(cfg, LmdbTierConfig):
            try:
                Path(cfg.path).mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryFile(dir=cfg.path):
                    pass
            except OSError as exc:
                raise ConfigError(
                    f"{where}: field 'path': cannot use {cfg.path!r} as the LMDB "
                    f"directory: {exc.strerror or exc}"
                ) from None
