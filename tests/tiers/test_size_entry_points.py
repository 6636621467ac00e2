"""Issue 20, point 6: one size grammar. A tier YAML, ``kvtier cache-server``'s flags,
``kvtier serve``'s flags and ``kvtier analyze --tier`` read ``4GiB`` as the same 4 * 2^30 bytes
and all refuse a bare number with a one-line error naming the value and the field or flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tiers.config import BYTES, ConfigError, load_tier_config

FOUR_GIB = 4 * 2**30
NO_UNIT = "'4096' has no unit; write bytes as 4GiB, 512MiB, 100GB or 4096B"


def test_yaml_tier_config(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("tiers:\n  - {kind: host, capacity: 4GiB, slot_bytes: 4Mi}\n")
    host = load_tier_config(good).tiers[0]
    assert (host.capacity, host.slot_bytes) == (FOUR_GIB, 4 * 2**20)
    bare = tmp_path / "bare.yaml"
    bare.write_text("tiers:\n  - {kind: host, capacity: 4096}\n")  # a YAML int
    with pytest.raises(ConfigError) as info:
        load_tier_config(bare)
    assert str(info.value).startswith(
        f"{bare}: tiers[0] (host): field 'capacity': 4096 has no unit; write bytes as 4GiB"
    )
    assert "\n" not in str(info.value)


def _cache_server_args(*flags: str) -> argparse.Namespace:
    from cachestore.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(flags))


def test_cache_server_flags(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from cachestore.server.cli import main, stack_configs

    host, lmdb = stack_configs(
        _cache_server_args(
            "--host-capacity", "4GiB", "--data-dir", str(tmp_path), "--lmdb-capacity", "4G"
        )
    )
    assert (host.capacity, host.slot_bytes) == (FOUR_GIB, 4 * 2**20)
    assert lmdb.capacity == 4 * 10**9  # G is decimal, as in Kubernetes
    with pytest.raises(ValueError, match=f"^--host-capacity: {NO_UNIT}"):
        stack_configs(_cache_server_args("--host-capacity", "4096"))
    # The daemon itself: exit 2 with one line, before anything is bound or allocated.
    assert (
        main(_cache_server_args("--port", "0", "--admin-port", "-1", "--host-capacity", "4096"))
        == 2
    )
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"kvtier cache-server: --host-capacity: {NO_UNIT} (Gi/GiB = 2^30, G/GB = 10^9)"
    ]


def test_serve_flags(capsys: pytest.CaptureFixture) -> None:
    from engine.server.cli import add_arguments

    parser = argparse.ArgumentParser(prog="kvtier serve")
    add_arguments(parser)
    assert parser.parse_args(["--max-body-bytes", "4GiB"]).max_body_bytes == FOUR_GIB
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-body-bytes", "4096"])
    assert f"argument --max-body-bytes: {NO_UNIT}" in capsys.readouterr().err


def test_analyze_tier_flag() -> None:
    from cachestore.analyze.cli import parse_tier

    spec, size = parse_tier("host=4GiB", "lru", 16, 131072)
    assert (size.unit, size.amount) == (BYTES, FOUR_GIB)
    assert spec.capacity_blocks == FOUR_GIB // (16 * 131072) == 2048
    with pytest.raises(ValueError) as info:
        parse_tier("host=4096", "lru", 16, 131072)
    assert str(info.value).startswith(f"--tier host=4096: {NO_UNIT}")
    assert "blocks as 1000blocks; tokens as 3Mtok; inf for unbounded" in str(info.value)


def test_cache_server_resource_errors_name_the_tier_file(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from cachestore.server.cli import main

    tiers = tmp_path / "tiers.yaml"
    tiers.write_text("tiers:\n  - {kind: lmdb, path: /proc/kvtier-no/lmdb, capacity: 1MiB}\n")
    assert (
        main(_cache_server_args("--port", "0", "--admin-port", "-1", "--config", str(tiers))) == 2
    )
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        f"kvtier cache-server: {tiers}: tiers[0] (lmdb): field 'path': "
        "cannot use '/proc/kvtier-no/lmdb' as the LMDB directory"
    ), line
