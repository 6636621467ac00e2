"""Tier configuration: the documented YAML parses; every backend field reaches the backend's own
config and the built tier; every error names its tier and field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tiers import build_tiers
from tiers.config import (
    BLOCKS,
    BYTES,
    STORE_FIELDS,
    TOKENS,
    UNBOUNDED,
    ConfigError,
    HostTierConfig,
    LmdbTierConfig,
    RedisTierConfig,
    RemoteTierConfig,
    S3TierConfig,
    Size,
    format_size,
    load_tier_config,
    parse_quantity,
    parse_size,
    parse_tier_config,
    parse_tier_entry,
)

EXAMPLE = """
tiers:
  - {kind: host, capacity: 4GiB}
  - {kind: lmdb, path: /tmp/kvtier-lmdb, capacity: 100GiB}
  - {kind: redis, url: "redis://127.0.0.1:6379/0", ttl_s: 3600}
  - {kind: s3, bucket: kv, endpoint_url: "http://127.0.0.1:9000", prefix: kv/, blocks_per_object: 16}
  - {kind: remote, url: "tcp://cache:7000", token: s3cret}
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 * 2**30),
        ("4Gi", 4 * 2**30),
        ("4G", 4 * 10**9),
        ("100GB", 100 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1024B", 1024),
        ("1.5 KiB", 1536),
        ("2tb", 2 * 10**12),
        ("7B", 7),
        ("0.5MiB", 2**19),
        ("3 bytes", 3),
        ("1k", 1000),
        ("1Ki", 1024),
        ("1Pi", 2**50),
        (" 8 MiB ", 8 * 2**20),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "4096",
            "'4096' has no unit; write bytes as 4GiB, 512MiB, 100GB or 4096B "
            "(Gi/GiB = 2^30, G/GB = 10^9)",
        ),
        (4096, "4096 has no unit; write bytes as 4GiB"),  # a YAML int: no bare bytes either
        (1.5, "1.5 has no unit"),
        ("GiB", "cannot parse size 'GiB'; write bytes as 4GiB"),
        ("-1GiB", "'-1GiB' is negative"),
        (True, "expected a size like '4GiB', got True (bool)"),
        ("0.3B", "'0.3B' is not a whole number of bytes"),
        ("4 parsecs", "unknown unit 'parsecs' in '4 parsecs'"),
        ("1000blocks", "'1000blocks' is in blocks, which this setting does not take"),
        ("3Mtok", "'3Mtok' is in tokens, which this setting does not take"),
        ("inf", "'inf' (unbounded) is not allowed here"),
    ],
)
def test_parse_size_errors(text: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(text)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_parse_size_names_the_flag() -> None:
    with pytest.raises(ValueError, match=r"^--host-capacity: '4096' has no unit; write bytes"):
        parse_size("4096", "--host-capacity")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", Size(BYTES, 4 * 2**30, "4GiB")),
        ("1000blocks", Size(BLOCKS, 1000, "1000blocks")),
        ("1000 blocks", Size(BLOCKS, 1000, "1000 blocks")),
        ("1 block", Size(BLOCKS, 1, "1 block")),
        ("2kblocks", Size(BLOCKS, 2000, "2kblocks")),
        ("3Mtok", Size(TOKENS, 3 * 10**6, "3Mtok")),
        ("500ktok", Size(TOKENS, 500_000, "500ktok")),
        ("1Mitok", Size(TOKENS, 2**20, "1Mitok")),
        ("3M tokens", Size(TOKENS, 3 * 10**6, "3M tokens")),
        ("2.5ktok", Size(TOKENS, 2500, "2.5ktok")),
        ("inf", Size(UNBOUNDED, None, "inf")),
        ("Unbounded", Size(UNBOUNDED, None, "Unbounded")),
        ("0blocks", Size(BLOCKS, 0, "0blocks")),
    ],
)
def test_parse_quantity_kinds(text: str, expected: Size) -> None:
    assert parse_quantity(text, "--tier", (BYTES, BLOCKS, TOKENS, UNBOUNDED)) == expected


def test_parse_quantity_errors_list_what_the_caller_takes() -> None:
    every = (BYTES, BLOCKS, TOKENS, UNBOUNDED)
    with pytest.raises(ValueError) as info:
        parse_quantity("1000", "--tier host=1000", every)
    assert str(info.value) == (
        "--tier host=1000: '1000' has no unit; write bytes as 4GiB, 512MiB, 100GB or 4096B "
        "(Gi/GiB = 2^30, G/GB = 10^9); blocks as 1000blocks; tokens as 3Mtok; inf for unbounded"
    )
    with pytest.raises(ValueError, match=r"'1.5blocks' is not a whole number of blocks"):
        parse_quantity("1.5blocks", "", every)
    with pytest.raises(ValueError, match=r"unknown unit 'ok' in '4ok'"):
        parse_quantity("4ok", "", every)


def test_format_size() -> None:
    assert [format_size(n) for n in (4 * 2**30, 1536, 1000, 2**20)] == [
        "4GiB",
        "1536B",
        "1000B",
        "1MiB",
    ]
    assert parse_size(format_size(3 * 2**40)) == 3 * 2**40


def test_example_yaml_parses(tmp_path: Path) -> None:
    path = tmp_path / "tiers.yaml"
    path.write_text(EXAMPLE)
    cfg = load_tier_config(path)
    assert cfg.tiers == (
        HostTierConfig(capacity=4 * 2**30),
        LmdbTierConfig(path="/tmp/kvtier-lmdb", capacity=100 * 2**30),
        RedisTierConfig(url="redis://127.0.0.1:6379/0", ttl_s=3600.0),
        S3TierConfig(
            bucket="kv", endpoint_url="http://127.0.0.1:9000", prefix="kv/", blocks_per_object=16
        ),
        RemoteTierConfig(url="tcp://cache:7000", token="s3cret"),
    )
    assert cfg.tiers[1].map_headroom == 0.25 and cfg.tiers[2].key_prefix == "kvtier:"
    assert "s3cret" not in repr(cfg) and "6379" not in repr(cfg)  # secrets stay out of logs
    with pytest.raises(AttributeError):
        cfg.tiers[0].capacity = 1  # type: ignore[misc]  # frozen


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"tiers": []}, "field 'tiers' is empty"),
        ({}, "field 'tiers' must be a list"),
        ([1], "must be a mapping"),
        ({"tiers": [], "extra": 1}, "unknown top-level field(s) ['extra']"),
        ({"tiers": [{"kind": "floppy"}]}, "tiers[0]: unknown kind 'floppy'"),
        ({"tiers": [{"capacity": "1GiB"}]}, "tiers[0]: missing field 'kind'"),
        ({"tiers": ["host"]}, "tiers[0]: expected a mapping"),
        ({"tiers": [{"kind": "host"}]}, "tiers[0] (host): missing required field 'capacity'"),
        (
            {"tiers": [{"kind": "host", "capacity": "4 parsecs"}]},
            "tiers[0] (host): field 'capacity': unknown unit 'parsecs' in '4 parsecs'",
        ),
        (
            {"tiers": [{"kind": "host", "capacity": "0B"}]},
            "field 'capacity': expected a positive size",
        ),
        (
            {"tiers": [{"kind": "host", "capacity": 4096}]},
            "tiers[0] (host): field 'capacity': 4096 has no unit; write bytes as 4GiB",
        ),
        (
            {"tiers": [{"kind": "host", "capacity": "1GiB", "colour": "red"}]},
            "tiers[0] (host): unknown field(s) ['colour']",
        ),
        (
            {"tiers": [{"kind": "host", "capacity": "1GiB"}, {"kind": "lmdb", "capacity": "1GiB"}]},
            "tiers[1] (lmdb): missing required field 'path'",
        ),
        (
            {"tiers": [{"kind": "s3", "bucket": "b", "blocks_per_object": 0}]},
            "tiers[0] (s3): field 'blocks_per_object': expected a positive integer, got 0",
        ),
        (
            {"tiers": [{"kind": "redis", "url": "redis://x", "ttl_s": "soon"}]},
            "tiers[0] (redis): field 'ttl_s': expected a positive number",
        ),
        (
            {
                "tiers": [
                    {"kind": "lmdb", "path": "/x", "capacity": "1B"},
                    {"kind": "host", "capacity": "1B"},
                ]
            },
            "a 'host' tier may only be the first",
        ),
    ],
)
def test_errors_name_the_field(data: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_tier_config(data)
    assert message in str(info.value)


def test_bad_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("tiers: [ {kind: host")
    with pytest.raises(ConfigError) as info:
        load_tier_config(path)
    # One line naming the file and the place, not PyYAML's multi-line "<unicode string>" text.
    assert str(info.value).startswith(f"{path}: line 1, column ")
    assert "\n" not in str(info.value) and "unicode string" not in str(info.value)
    with pytest.raises(ConfigError, match="missing.yaml: cannot read it"):
        load_tier_config(tmp_path / "missing.yaml")


def test_build_tiers_through_registry(tmp_path: Path) -> None:
    cfg = parse_tier_config(
        {
            "tiers": [
                {"kind": "host", "capacity": "64KiB"},
                {"kind": "lmdb", "path": str(tmp_path / "db"), "capacity": "1MiB"},
            ]
        }
    )
    with pytest.raises(ConfigError, match="'slot_bytes' is not set"):
        build_tiers(cfg)
    tiers = build_tiers(cfg, host_slot_bytes=4096)
    try:
        assert [type(t).__name__ for t in tiers] == ["HostTier", "LmdbTier"]
        assert tiers[0].usage().capacity_bytes == 64 * 1024
        assert tiers[1].usage().capacity_bytes == 2**20
        assert tiers[1]._buffers.max_idle_bytes == 256 * 2**20  # type: ignore[attr-defined]
    finally:
        for tier in tiers:
            tier.close()


def test_lmdb_read_buffer_bytes_parses_and_reaches_the_tier(tmp_path: Path) -> None:
    import inspect

    from tiers.lmdb import LmdbTier

    default = inspect.signature(LmdbTier).parameters["read_buffer_bytes"].default
    assert LmdbTierConfig(path="/x", capacity=1).read_buffer_bytes == default
    cfg = parse_tier_config(
        {
            "tiers": [
                {
                    "kind": "lmdb",
                    "path": str(tmp_path / "db"),
                    "capacity": "1MiB",
                    "read_buffer_bytes": "32MiB",
                }
            ]
        }
    )
    assert cfg.tiers[0].read_buffer_bytes == 32 * 2**20
    (tier,) = build_tiers(cfg)
    try:
        assert tier._buffers.max_idle_bytes == 32 * 2**20  # type: ignore[attr-defined]
    finally:
        tier.close()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (1024, "field 'read_buffer_bytes': 1024 has no unit"),
        ("0B", "field 'read_buffer_bytes': expected a positive size, got '0B'"),
        ("1000tok", "field 'read_buffer_bytes': '1000tok' is in tokens"),
    ],
)
def test_lmdb_read_buffer_bytes_errors(value: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_tier_config(
            {
                "tiers": [
                    {"kind": "lmdb", "path": "/x", "capacity": "1MiB", "read_buffer_bytes": value}
                ]
            }
        )
    assert str(info.value).startswith("tiers[0] (lmdb): ") and message in str(info.value)
    assert "\n" not in str(info.value)


REDIS_FULL = {
    "kind": "redis",
    "url": "redis://127.0.0.1:6379/2",
    "cluster": False,
    "key_prefix": "kv:",
    "ttl_s": 60,
    "max_value_bytes": "8MiB",
    "socket_timeout_s": 0.5,
    "connect_timeout_s": 0.25,
    "max_connections": 8,
    "retries": 0,
    "capacity": "1GiB",
    "read_connections": 8,
}
S3_FULL = {
    "kind": "s3",
    "bucket": "kv",
    "endpoint_url": "http://127.0.0.1:9000",
    "prefix": "p/",
    "blocks_per_object": 4,
    "region": "eu-west-1",
    "access_key_id": "AK",
    "secret_access_key": "SK",
    "timeout_s": 3,
    "connect_timeout_s": 0.5,
    "max_attempts": 1,
    "max_pool_connections": 4,
    "read_chunk_bytes": "8MiB",
}


def test_backend_fields_parse_and_reach_the_backend_configs() -> None:
    from tiers.redis import RedisTierConfig as RedisBackend
    from tiers.s3 import S3TierConfig as S3Backend
    from tiers.shared import config_as

    redis_cfg, s3_cfg = parse_tier_config({"tiers": [REDIS_FULL, S3_FULL]}).tiers
    assert redis_cfg == RedisTierConfig(
        url="redis://127.0.0.1:6379/2",
        cluster=False,
        key_prefix="kv:",
        ttl_s=60.0,
        max_value_bytes=8 * 2**20,
        socket_timeout_s=0.5,
        connect_timeout_s=0.25,
        max_connections=8,
        retries=0,
        capacity=2**30,
        read_connections=8,
    )
    assert s3_cfg == S3TierConfig(
        bucket="kv",
        endpoint_url="http://127.0.0.1:9000",
        prefix="p/",
        blocks_per_object=4,
        region="eu-west-1",
        access_key_id="AK",
        secret_access_key="SK",
        timeout_s=3.0,
        connect_timeout_s=0.5,
        max_attempts=1,
        max_pool_connections=4,
        read_chunk_bytes=8 * 2**20,
    )
    # Every YAML field exists, with the same value, on the backend's own config (the registry
    # converts by name, so a field missing there would be silently dropped), but the store's.
    for parsed, backend_cls in ((redis_cfg, RedisBackend), (s3_cfg, S3Backend)):
        backend = config_as(parsed, backend_cls)
        for f in dataclasses.fields(parsed):
            if f.name in STORE_FIELDS:
                continue
            assert getattr(backend, f.name) == getattr(parsed, f.name), f.name
    assert "SK" not in repr(s3_cfg) and "6379" not in repr(redis_cfg)


def test_backend_defaults_match_the_backends() -> None:
    from tiers.redis import RedisTierConfig as RedisBackend
    from tiers.s3 import S3TierConfig as S3Backend

    redis_cfg = RedisTierConfig(url="redis://h:6379/0")
    s3_cfg = S3TierConfig(bucket="b")
    for parsed, backend in (
        (redis_cfg, RedisBackend(url="redis://h:6379/0")),
        (s3_cfg, S3Backend(bucket="b")),
    ):
        for f in dataclasses.fields(parsed):
            if f.name in STORE_FIELDS:
                continue
            assert getattr(backend, f.name) == getattr(parsed, f.name), f.name
    assert redis_cfg.capacity is None and redis_cfg.retries == 1
    assert s3_cfg.max_attempts == 2 and s3_cfg.max_pool_connections == 32
    assert (redis_cfg.read_connections, s3_cfg.read_chunk_bytes) == (4, 64 * 2**20)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"cluster": "yes"}, "field 'cluster': expected true or false, got 'yes'"),
        ({"max_value_bytes": "0MiB"}, "field 'max_value_bytes': expected a positive size"),
        ({"max_value_bytes": 1024}, "field 'max_value_bytes': 1024 has no unit"),
        ({"max_value_bytes": "lots"}, "field 'max_value_bytes': cannot parse size"),
        ({"connect_timeout_s": 0}, "field 'connect_timeout_s': expected a positive number, got 0"),
        ({"retries": -1}, "field 'retries': expected a non-negative integer, got -1"),
        ({"retries": 1.5}, "field 'retries': expected a non-negative integer"),
        ({"capacity": "0B"}, "field 'capacity': expected a positive size"),
        ({"capacity": "1GiB", "cluster": True}, "field 'capacity' needs a single Redis server"),
        (
            {"capacity": "1GiB", "url": "redis+cluster://h:7000"},
            "field 'capacity' needs a single Redis server",
        ),
        ({"read_connections": 0}, "field 'read_connections': expected a positive integer, got 0"),
        # Caught at start-up, not after the model loaded (they failed in the engine core).
        ({"url": "redis://h:99999/0"}, "field 'url': the port must be a number 1..65535"),
        ({"url": "redis://h:port/0"}, "field 'url': the port must be a number 1..65535"),
        ({"url": "redis://:pw@h:6379/x"}, "field 'url': the database must be a number"),
        ({"read_connections": "4"}, "field 'read_connections': expected a positive integer"),
        (
            {"read_connections": 9, "max_connections": 8},
            "field 'read_connections': 9 is more than max_connections (8)",
        ),
        (
            {"read_connections": 65},
            "field 'read_connections': 65 is more than max_connections (64)",
        ),
    ],
)
def test_redis_field_errors(entry: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_tier_config({"tiers": [{"kind": "redis", "url": "redis://h:6379/0", **entry}]})
    assert str(info.value).startswith("tiers[0] (redis): ") and message in str(info.value)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"connect_timeout_s": -1}, "field 'connect_timeout_s': expected a positive number"),
        ({"max_attempts": 0}, "field 'max_attempts': expected a positive integer, got 0"),
        ({"max_pool_connections": "many"}, "field 'max_pool_connections': expected a positive"),
        ({"max_pool_connections": True}, "field 'max_pool_connections': expected a positive"),
        ({"capacity": "1TiB"}, "unknown field(s) ['capacity']"),
        ({"read_chunk_bytes": 8388608}, "field 'read_chunk_bytes': 8388608 has no unit"),
        ({"read_chunk_bytes": "0MiB"}, "field 'read_chunk_bytes': expected a positive size"),
        ({"read_chunk_bytes": "8 blocks"}, "field 'read_chunk_bytes': '8 blocks' is in blocks"),
        ({"endpoint_url": "not a url"}, "field 'endpoint_url' must be http(s)://HOST[:PORT]"),
        ({"endpoint_url": "s3.amazonaws.com"}, "field 'endpoint_url' must be http(s)://HOST"),
        ({"endpoint_url": "http://minio:0"}, "field 'endpoint_url': the port must be a number"),
    ],
)
def test_s3_field_errors(entry: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_tier_config({"tiers": [{"kind": "s3", "bucket": "b", **entry}]})
    assert str(info.value).startswith("tiers[0] (s3): ") and message in str(info.value)


def test_built_redis_and_s3_tiers_carry_the_fields(redis_config: dict, s3_config: dict) -> None:
    cfg = parse_tier_config(
        {
            "tiers": [
                {
                    **redis_config,
                    "connect_timeout_s": 0.25,
                    "retries": 0,
                    "capacity": "4KiB",
                    "max_value_bytes": "1KiB",
                    "read_connections": 3,
                },
                {
                    **s3_config,
                    "connect_timeout_s": 0.5,
                    "max_attempts": 1,
                    "max_pool_connections": 3,
                    "read_chunk_bytes": "1MiB",
                },
            ]
        }
    )
    redis_tier, s3_tier = build_tiers(cfg)
    try:
        rc, sc = redis_tier.config, s3_tier.config  # type: ignore[attr-defined]
        assert (rc.connect_timeout_s, rc.retries, rc.capacity) == (0.25, 0, 4096)
        assert redis_tier.usage().capacity_bytes == 4096
        assert redis_tier.put_many([("k", b"x" * 1025)]) == []  # over max_value_bytes: skipped
        assert redis_tier.get_many(["k"]) == [None]
        assert (sc.connect_timeout_s, sc.max_attempts, sc.max_pool_connections) == (0.5, 1, 3)
        assert s3_tier._pool._max_workers == 3  # type: ignore[attr-defined]
        assert (rc.read_connections, sc.read_chunk_bytes) == (3, 2**20)
        assert redis_tier._readers._max_workers == 2  # type: ignore[attr-defined]
    finally:
        for tier in (redis_tier, s3_tier):
            tier.close()


def test_remote_fields_parse_with_defaults() -> None:
    cfg = parse_tier_entry(
        {
            "kind": "remote",
            "url": "tcp://cache:7000",
            "token_file": "/run/secrets/kv",
            "timeout_ms": 250,
        }
    )
    assert cfg == RemoteTierConfig(
        url="tcp://cache:7000", token_file="/run/secrets/kv", timeout_ms=250
    )
    assert cfg.effective_timeout_s == 0.25 and cfg.token is None
    plain = parse_tier_entry({"kind": "remote", "url": "ipc:///tmp/kv.sock"})
    assert (plain.timeout_s, plain.timeout_ms, plain.effective_timeout_s) == (None, None, 5.0)
    seconds = parse_tier_entry({"kind": "remote", "url": "tcp://h:1", "timeout_s": 2})
    assert seconds.effective_timeout_s == 2.0


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"token": "a", "token_file": "/f"}, "'token' and 'token_file' are mutually exclusive"),
        (
            {"timeout_s": 1, "timeout_ms": 1000},
            "'timeout_s' and 'timeout_ms' are mutually exclusive",
        ),
        ({"timeout_ms": 0}, "field 'timeout_ms': expected a positive integer, got 0"),
        ({"timeout_ms": 1.5}, "field 'timeout_ms': expected a positive integer, got 1.5"),
        ({"timeout_s": -2}, "field 'timeout_s': expected a positive number"),
        ({"token_file": ""}, "field 'token_file': expected a non-empty string"),
        ({"url": "http://cache:7000"}, "field 'url' must be tcp://HOST:PORT or ipc://PATH"),
        ({"url": "tcp://127.0.0.1"}, "field 'url' must be tcp://HOST:PORT, got"),
        ({"url": "tcp://cache:70000"}, "field 'url': the port must be a number 1..65535"),
        ({"url": "ipc://"}, "field 'url': ipc:// needs a path"),
        ({"timeout": 3}, "unknown field(s) ['timeout']"),
    ],
)
def test_remote_field_errors(entry: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_tier_config({"tiers": [{"kind": "remote", "url": "tcp://cache:7000", **entry}]})
    assert str(info.value).startswith("tiers[0] (remote): ") and message in str(info.value)


def test_start_checks_name_the_tier_and_field(tmp_path: Path) -> None:
    """Issue 16 F5: a host tier larger than the memory available and an unusable LMDB path
    are ConfigErrors naming the tier and the field, before anything is allocated."""
    from tiers.config import check_resources

    host = parse_tier_config({"tiers": [{"kind": "host", "capacity": "4TiB"}]})
    with pytest.raises(
        ConfigError,
        match=r"tiers\[0\] \(host\): field 'capacity': 4.0 TiB "
        r"is more than .*24.0 GiB.*MemAvailable",
    ):
        check_resources(host, mem_available=24 << 30)
    check_resources(host, mem_available=5 << 40)  # fits
    with pytest.raises(ConfigError, match="MemAvailable"):  # build_tiers checks first
        build_tiers(
            parse_tier_config(
                {"tiers": [{"kind": "host", "capacity": "1024TiB", "slot_bytes": "4KiB"}]}
            )
        )
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for bad in (blocker / "lmdb", Path("/proc/kvtier-no/lmdb")):
        lmdb = parse_tier_config(
            {
                "tiers": [
                    {"kind": "host", "capacity": "1MiB"},
                    {"kind": "lmdb", "path": str(bad), "capacity": "1MiB"},
                ]
            }
        )
        with pytest.raises(ConfigError, match=r"tiers\[1\] \(lmdb\): field 'path': cannot use "):
            check_resources(lmdb)
    good = parse_tier_config(
        {"tiers": [{"kind": "lmdb", "path": str(tmp_path / "a" / "b"), "capacity": "1MiB"}]}
    )
    check_resources(good)
    assert (tmp_path / "a" / "b").is_dir()


def test_start_checks_name_the_file_they_came_from(tmp_path: Path) -> None:
    """The file is named in front of the tier and the field, as a YAML error names it."""
    from tiers.config import check_resources

    path = tmp_path / "tiers.yaml"
    path.write_text(
        "tiers:\n  - {kind: host, capacity: 4TiB}\n"
        "  - {kind: lmdb, path: /proc/kvtier-no/lmdb, capacity: 1MiB}\n"
    )
    config = load_tier_config(path)
    with pytest.raises(ConfigError) as info:
        check_resources(config, mem_available=24 << 30, source=path)
    assert str(info.value) == (
        f"{path}: tiers[0] (host): field 'capacity': 4.0 TiB is more "
        "than the memory available on this machine (24.0 GiB, "
        "/proc/meminfo MemAvailable)"
    )
    with pytest.raises(ConfigError) as info:
        check_resources(config, mem_available=5 << 40, source=path)
    assert str(info.value).startswith(
        f"{path}: tiers[1] (lmdb): field 'path': cannot use "
        "'/proc/kvtier-no/lmdb' as the LMDB directory: "
    )


def test_yaml_errors_name_the_file(tmp_path: Path) -> None:
    from connectors.offload.config import load_offload_config

    broken = tmp_path / "broken.yaml"
    broken.write_text("tiers: [{kind: host, capacity: 4GiB\n")
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("tiers:\n  - {kind: host, capacity: lots}\n")
    for path in (broken, wrong):
        for load in (load_tier_config, load_offload_config):
            with pytest.raises(ConfigError, match=str(path)):
                load(path)
    with pytest.raises(ConfigError, match=r"wrong.yaml: tiers\[0\] \(host\): field 'capacity'"):
        load_tier_config(wrong)


def test_cache_server_refuses_a_host_tier_larger_than_the_machine(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.cli",
            "cache-server",
            "--port",
            "0",
            "--admin-port",
            "-1",
            "--host-capacity",
            "1024TiB",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert "(host): field 'capacity'" in run.stderr and "MemAvailable" in run.stderr
    lines = [x for x in run.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, run.stderr  # one clear line, no traceback
