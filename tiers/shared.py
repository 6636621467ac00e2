"""Small helpers the backend tiers (lmdb, redis, s3) share, so each rule is written once.

- ``backend_errors``: turn a backend's exceptions into ``TierError`` with one message format,
  and refuse calls on a closed tier.
- ``config_as``: ``config`` as a given dataclass, rebuilt from the fields both share (each tier
  kind has one config class, ``tiers.config``, so the backends need no conversion).
- ``nbytes`` and ``last_value_wins``: value size and the "a key given twice keeps its last value"
  rule of ``put_many``.

Pure functions, no state: thread-safe. Torch-free; imports no backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from tiers.base import TierError, Value

C = TypeVar("C")


@contextmanager
def backend_errors(
    errors: tuple[type[BaseException], ...], kind: str, op: str, where: str, *, closed: bool = False
) -> Iterator[None]:
    """Run the body; re-raise any of ``errors`` as ``TierError("{kind} {op} {where}: {exc}")``
    (the backend exception chained as its cause). ``closed``: raise
    ``TierError("{kind} tier {op} after close")`` before running anything."""
    if closed:
        raise TierError(f"{kind} tier {op} after close")
    try:
        yield
    except errors as exc:
        raise TierError(f"{kind} {op} {where}: {exc}") from exc


def config_as(config: Any, backend_cls: type[C]) -> C:
    """``config`` itself if it is a ``backend_cls``, else a ``backend_cls`` (a dataclass) built
    from the fields both share; fields ``config`` lacks take ``backend_cls``'s defaults.
    Raises what ``backend_cls`` raises for bad values (ValueError)."""
    if isinstance(config, backend_cls):
        return config
    names = [f.name for f in dataclasses.fields(backend_cls)]  # type: ignore[arg-type]
    return backend_cls(**{n: getattr(config, n) for n in names if hasattr(config, n)})


def nbytes(value: Value) -> int:
    """Length of an encoded block in bytes (a memoryview's ``len`` counts items, not bytes)."""
    return value.nbytes if isinstance(value, memoryview) else len(value)


def last_value_wins(items: Sequence[tuple[str, Value]]) -> list[tuple[str, Value]]:
    """``items`` with each repeated key kept once: its last value, at its last position."""
    last = {key: idx for idx, (key, _) in enumerate(items)}
    return [item for idx, item in enumerate(items) if last[item[0]] == idx]
