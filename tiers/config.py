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

Read-path knobs (``docs/tiers.md``): ``read_connections`` (redis: parallel pipelines per
``get_many``, at most ``max_connections``), ``read_chunk_bytes`` (s3: the size of the parallel
range GETs a group's span is split into) and ``read_buffer_bytes`` (lmdb: idle recycled read
buffers kept, ``tiers.buffers``).

Every tier below the top has a write policy (``cachestore.store.write_through``): ``write_policy``
``write_through`` (the default for lmdb, redis, s3 and remote: a block saved to the top tier is
copied there asynchronously), ``write_through_selective`` (copied at its ``write_through_hits``-th
hit) or ``write_back`` (only what the tier above evicts); ``write_queue_blocks`` bounds the copy
queue (a full queue drops the copy, never stalls); the store reads these fields
(``cachestore.store.types.write_policies``). Errors raise ConfigError naming the tier and the
field. Building tiers is ``tiers.build_tiers`` (the registry, so optional backends load only
when chosen); each kind has one config class, here, which its backend takes as is; this module
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
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit, urlunsplit

from tiers.config_fields import (
    STORE_FIELDS,
    WRITE_BACK,
    WRITE_POLICIES,
    WRITE_THROUGH,
    WRITE_THROUGH_SELECTIVE,
    ConfigError,
    _bool,
    _f,
    _nonneg_int,
    _policy,
    _pos_float,
    _pos_int,
    _size,
    _str,
)
from tiers.sizes import (
    BLOCKS,
    BYTES,
    TOKENS,
    UNBOUNDED,
    Size,
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
class HostTierConfig:
    """Pinned host memory. ``slot_bytes`` (max encoded block size) may come from the engine."""

    kind: ClassVar[str] = "host"
    capacity: int = _f(_size)
    slot_bytes: int | None = _f(_size, None)
    pin_memory: bool | None = _f(_bool, None)  # None: pin when CUDA is available


@dataclass(frozen=True, slots=True)
class LmdbTierConfig:
    kind: ClassVar[str] = "lmdb"
    path: str = _f(_str)
    capacity: int = _f(_size)
    map_headroom: float = _f(_pos_float, 0.25)  # map size = capacity * (1 + headroom) + 64MiB
    writer_queue_size: int = _f(_pos_int, 256)
    sync: bool = _f(_bool, False)  # a cache: losing the last writes on power loss is fine
    read_buffer_bytes: int = _f(_size, 256 << 20)  # idle recycled read buffers kept (get_many)
    write_policy: str = _f(_policy, WRITE_THROUGH)
    write_through_hits: int = _f(_pos_int, 2)  # write_through_selective: copied at this hit
    write_queue_blocks: int = _f(_pos_int, 1024)  # write-through queue bound, in blocks


REDIS_MAX_BULK_BYTES = 512 * 1024 * 1024  # Redis' default proto-max-bulk-len
# Cluster URL schemes -> the scheme redis-py's cluster client takes.
REDIS_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs and repr)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


@dataclass(frozen=True, slots=True)
class RedisTierConfig:
    """One Redis (or Redis Cluster) tier (``tiers.redis``). ``url`` may carry credentials;
    repr hides it. The checks run however the config is built (YAML or code)."""

    kind: ClassVar[str] = "redis"
    url: str = _f(_str, "redis://127.0.0.1:6379/0", secret=True, required=True)
    cluster: bool = _f(_bool, False)
    key_prefix: str = _f(_str, "kvtier:")  # lets kvtier share a database, scanned apart
    ttl_s: float | None = _f(_pos_float, None)  # None: kept until the server evicts
    max_value_bytes: int = _f(_size, REDIS_MAX_BULK_BYTES)
    socket_timeout_s: float = _f(_pos_float, 2.0)
    connect_timeout_s: float = _f(_pos_float, 1.0)
    max_connections: int = _f(_pos_int, 64)
    retries: int = _f(_nonneg_int, 1)  # on connection errors/timeouts, 10-100 ms backoff
    capacity: int | None = _f(_size, None)  # bytes; None: the server's maxmemory bounds it
    read_connections: int = _f(_pos_int, 4)  # parallel pipelines one get_many may use
    write_policy: str = _f(_policy, WRITE_THROUGH)
    write_through_hits: int = _f(_pos_int, 2)  # write_through_selective: copied at this hit
    write_queue_blocks: int = _f(_pos_int, 1024)  # write-through queue bound, in blocks

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in {"redis", "rediss", "unix", *REDIS_CLUSTER_SCHEMES}:
            raise ValueError(
                f"redis url must be redis://, rediss://, unix:// or "
                f"redis+cluster://, got {redact_url(self.url)!r}"
            )
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {self.ttl_s}")
        if self.max_value_bytes <= 0:
            raise ValueError(f"max_value_bytes must be positive, got {self.max_value_bytes}")
        if self.socket_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("socket_timeout_s and connect_timeout_s must be positive")
        if self.max_connections <= 0 or self.retries < 0:
            raise ValueError("max_connections must be positive and retries non-negative")
        if self.read_connections > self.max_connections:
            raise ValueError(
                f"field 'read_connections': {self.read_connections} is more than "
                f"max_connections ({self.max_connections})"
            )
        if self.read_connections <= 0:
            raise ValueError(f"read_connections must be positive, got {self.read_connections}")
        if self.capacity is not None and self.capacity <= 0:
            raise ValueError(f"capacity must be positive or None, got {self.capacity}")
        if self.capacity is not None and (self.cluster or scheme in REDIS_CLUSTER_SCHEMES):
            # Its LRU scripts touch keys in many hash slots.
            raise ValueError(
                "field 'capacity' needs a single Redis server, not a cluster "
                "(bound each shard with maxmemory instead)"
            )


@dataclass(frozen=True, slots=True)
class S3TierConfig:
    """One bucket/prefix on an S3-compatible endpoint (``tiers.s3``). Keys: explicit, else
    boto3's chain; repr hides them. No ``capacity``: the bucket bounds itself (an S3
    lifecycle rule expiring ``prefix``). The checks run however the config is built."""

    kind: ClassVar[str] = "s3"
    bucket: str = _f(_str)
    endpoint_url: str | None = _f(_str, None)
    prefix: str = _f(_str, "kv/")
    blocks_per_object: int = _f(_pos_int, 16)
    region: str = _f(_str, "us-east-1")
    access_key_id: str | None = _f(_str, None, secret=True)
    secret_access_key: str | None = _f(_str, None, secret=True)
    timeout_s: float = _f(_pos_float, 10.0)
    connect_timeout_s: float = _f(_pos_float, 2.0)
    max_attempts: int = _f(_pos_int, 2)
    max_pool_connections: int = _f(_pos_int, 32)  # also the number of parallel requests
    # A group's span is read in range GETs of at most this many bytes, in parallel. AWS
    # serves 8-16 MiB ranges per connection best: lower it when a read touches few groups.
    # The default keeps a group of 16 x 2 MiB blocks one GET: S3-compatible servers that read
    # the whole object for every range (moto) pay the object size per piece.
    read_chunk_bytes: int = _f(_size, 64 << 20)
    write_policy: str = _f(_policy, WRITE_THROUGH)
    write_through_hits: int = _f(_pos_int, 2)  # write_through_selective: copied at this hit
    write_queue_blocks: int = _f(_pos_int, 1024)  # write-through queue bound, in blocks

    def __post_init__(self) -> None:
        if not self.bucket:
            raise ValueError("s3 tier needs a bucket")
        if self.blocks_per_object <= 0 or self.max_pool_connections <= 0:
            raise ValueError("blocks_per_object and max_pool_connections must be positive")
        if self.read_chunk_bytes <= 0:
            raise ValueError(f"read_chunk_bytes must be positive, got {self.read_chunk_bytes}")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0 or self.max_attempts <= 0:
            raise ValueError("timeouts and max_attempts must be positive")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("give both access_key_id and secret_access_key, or neither")


@dataclass(frozen=True, slots=True)
class RemoteTierConfig:
    """A ``kvtier cache-server`` reached over the network.

    At most one of ``token`` / ``token_file`` (a file holding the token, read when the tier is
    built, so the secret stays out of the YAML) and one of ``timeout_s`` / ``timeout_ms``
    (neither: 5 s)."""

    kind: ClassVar[str] = "remote"
    url: str = _f(_str)
    token: str | None = _f(_str, None, secret=True)
    token_file: str | None = _f(_str, None)
    timeout_s: float | None = _f(_pos_float, None)
    timeout_ms: int | None = _f(_pos_int, None)
    write_policy: str = _f(_policy, WRITE_THROUGH)
    write_through_hits: int = _f(_pos_int, 2)  # write_through_selective: copied at this hit
    write_queue_blocks: int = _f(_pos_int, 1024)  # write-through queue bound, in blocks

    def __post_init__(self) -> None:
        if not self.url.startswith(("tcp://", "ipc://")):
            raise ValueError(f"field 'url' must be tcp://HOST:PORT or ipc://PATH, got {self.url!r}")
        if self.token is not None and self.token_file is not None:
            raise ValueError("fields 'token' and 'token_file' are mutually exclusive")
        if self.timeout_s is not None and self.timeout_ms is not None:
            raise ValueError("fields 'timeout_s' and 'timeout_ms' are mutually exclusive")

    @property
    def effective_timeout_s(self) -> float:
        """``timeout_s``, else ``timeout_ms`` / 1000, else 5 s."""
        if self.timeout_s is not None:
            return self.timeout_s
        return self.timeout_ms / 1000 if self.timeout_ms is not None else 5.0


TierConfig = HostTierConfig | LmdbTierConfig | RedisTierConfig | S3TierConfig | RemoteTierConfig
CONFIG_CLASSES: dict[str, type[Any]] = {
    cls.kind: cls
    for cls in (HostTierConfig, LmdbTierConfig, RedisTierConfig, S3TierConfig, RemoteTierConfig)
}


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
                    f"{where}: field 'capacity': {_gib(cfg.capacity)} is more than the memory "
                    f"available on this machine ({_gib(mem)}, /proc/meminfo MemAvailable)"
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


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"
