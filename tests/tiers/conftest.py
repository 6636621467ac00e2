"""Tier fixtures for the contract suite: one ``make_tier`` per kind, built through the registry.

``make_tier(**overrides)`` parses ``{"kind": ..., **defaults, **overrides}`` with
``tiers.config.parse_tier_entry`` and builds it with ``tiers.create_tier``, exactly as
a YAML tier stack would be built. Calling it twice gives two client objects on the same backend
(same LMDB path, Redis database or S3 bucket) — the restart-persistence tests rely on that.
Every tier made is closed at teardown. A kind whose module does not exist yet is skipped with
the reason.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tiers.base import Tier

TIER_KINDS = ["host", "lmdb", "redis", "s3"]
BOUNDED_KINDS = {"host", "lmdb"}  # capacity set in the config; the tier evicts by itself
PERSISTENT_KINDS = {"lmdb", "redis", "s3"}  # a new client object sees what an old one wrote
MIB = 1024 * 1024
# The host tier's slot: the largest value the suite stores (2 MiB) plus room for a codec header.
HOST_SLOT_BYTES = 2 * MIB + 4096

MakeTier = Callable[..., Tier]


def _require_module(kind: str) -> None:
    try:
        importlib.import_module(f"tiers.{kind}")
    except ModuleNotFoundError as exc:
        if exc.name in (f"tiers.{kind}", "tiers"):
            pytest.skip(f"tiers/{kind}.py does not exist yet")
        pytest.skip(f"tiers.{kind} needs {exc.name!r}, not installed")


def _base_config(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    if kind == "host":
        return {
            "kind": "host",
            "capacity": f"{32 * HOST_SLOT_BYTES}B",
            "slot_bytes": f"{HOST_SLOT_BYTES}B",
        }
    if kind == "lmdb":
        return {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "128MiB"}
    if kind == "redis":
        return dict(request.getfixturevalue("redis_config"))
    return dict(request.getfixturevalue("s3_config"))


@pytest.fixture(params=TIER_KINDS)
def tier_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    _require_module(kind)
    return kind


@pytest.fixture
def make_tier(tier_kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeTier]:
    from tiers import create_tier
    from tiers.config import parse_tier_entry

    base = _base_config(tier_kind, request, tmp_path)
    made: list[Tier] = []

    def make(**overrides: Any) -> Tier:
        tier = create_tier(parse_tier_entry({**base, **overrides}, where=f"test {tier_kind}"))
        made.append(tier)
        return tier

    yield make
    for tier in reversed(made):
        tier.close()


@pytest.fixture
def tier(make_tier: MakeTier) -> Tier:
    """A fresh, empty tier of the parametrized kind."""
    return make_tier()
