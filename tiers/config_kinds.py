"""One frozen config class per tier kind: ``host``, ``lmdb``, ``redis``, ``s3``, ``remote``.

Each field's metadata says how its YAML value is parsed (``tiers.config_fields``); checks
across fields run in ``__post_init__`` however the config is built (YAML or code) and raise
ValueError (``tiers.config.parse_tier_entry`` names the tier). The backend of each kind takes
its config as is. Parsing a stack, reading a file and the start-time checks:
``tiers.config`` (which re-exports every name here).

Read-path knobs (``docs/tiers.md``): ``read_connections`` (redis: parallel pipelines per
``get_many``, at most ``max_connections``), ``read_chunk_bytes`` (s3: the size of the parallel
range GETs a group's span is split into) and ``read_buffer_bytes`` (lmdb: idle recycled read
buffers kept, ``tiers.buffers``).

Every tier below the top has a write policy (``cachestore.store.write_through``): ``write_policy``
``write_through`` (the default for lmdb, redis, s3 and remote: a block saved to the top tier is
copied there asynchronously), ``write_through_selective`` (copied at its ``write_through_hits``-th
hit) or ``write_back`` (only what the tier above evicts); ``write_queue_blocks`` bounds the copy
queue (a full queue drops the copy, never stalls); the store reads these fields
(``cachestore.store.types.write_policies``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

from tiers.config_fields import (
    WRITE_THROUGH,
    _bool,
    _f,
    _nonneg_int,
    _policy,
    _pos_float,
    _pos_int,
    _size,
    _str,
)


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
    writemap: bool = _f(_bool, False)  # pages written through the map (LmdbTier's docstring)
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
        parts = urlsplit(self.url)
        if parts.scheme not in {"redis", "rediss", "unix", *REDIS_CLUSTER_SCHEMES}:
            raise ValueError(
                f"redis url must be redis://, rediss://, unix:// or "
                f"redis+cluster://, got {redact_url(self.url)!r}"
            )
        if parts.scheme != "unix":
            url_port("url", self.url, redact_url(self.url))
            db = parts.path.strip("/")
            if parts.scheme in ("redis", "rediss") and db and not db.isdigit():
                raise ValueError(
                    f"field 'url': the database must be a number (redis://HOST:PORT/0), "
                    f"got {redact_url(self.url)!r}"
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
        if self.capacity is not None and (self.cluster or parts.scheme in REDIS_CLUSTER_SCHEMES):
            # Its LRU scripts touch keys in many hash slots.
            raise ValueError(
                "field 'capacity' needs a single Redis server, not a cluster "
                "(bound each shard with maxmemory instead)"
            )


def url_port(field: str, url: str, shown: str) -> int | None:
    """``url``'s port, None when it names none. Raises ValueError naming ``field`` for a port
    that is not a number in 1..65535 (``shown``: the URL as an error may print it)."""
    try:
        port = urlsplit(url).port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"field '{field}': the port must be a number 1..65535, got {shown!r}")
    return port


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
        if self.endpoint_url is not None:
            parts = urlsplit(self.endpoint_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(
                    f"field 'endpoint_url' must be http(s)://HOST[:PORT], got {self.endpoint_url!r}"
                )
            url_port("endpoint_url", self.endpoint_url, self.endpoint_url)
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
        if self.url.startswith("tcp://"):
            parts = urlsplit(self.url)
            if not parts.hostname or url_port("url", self.url, self.url) is None:
                raise ValueError(f"field 'url' must be tcp://HOST:PORT, got {self.url!r}")
        elif self.url == "ipc://":
            raise ValueError("field 'url': ipc:// needs a path (ipc:///run/kvtier/cache.sock)")
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
