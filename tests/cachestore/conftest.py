"""Fixtures shared by the cache-server tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tiers.remote.tier import RemoteTier


@pytest.fixture
def remote() -> Iterator[Callable[..., RemoteTier]]:
    """Makes RemoteTiers and closes them all at teardown, also when a test fails midway (a
    leaked client's ZMQ context would otherwise be torn down by the garbage collector)."""
    made: list[RemoteTier] = []

    def make(*args: Any, **kwargs: Any) -> RemoteTier:
        made.append(RemoteTier(*args, **kwargs))
        return made[-1]

    yield make
    for tier in made:
        tier.close()
