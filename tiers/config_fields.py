"""The field vocabulary of ``tiers.config``: write policies, ``ConfigError`` and the parsers
each YAML field runs (``_f`` declares a field with its parser). Pure; imports only
``tiers.sizes``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import field
from typing import Any

from tiers.sizes import parse_size

# When a block saved to the top tier reaches a lower tier (the store's ``WritePolicy``).
WRITE_THROUGH = "write_through"  # copied down as soon as it is saved to the top tier
WRITE_THROUGH_SELECTIVE = "write_through_selective"  # copied down at its ``hits``-th hit
WRITE_BACK = "write_back"  # copied down only when the tier above evicts it
WRITE_POLICIES = (WRITE_THROUGH, WRITE_THROUGH_SELECTIVE, WRITE_BACK)


class ConfigError(ValueError):
    """A tier configuration that cannot be used; the message names the tier and the field."""


def _str(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return value


def _pos_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"expected a positive integer, got {value!r}")
    return value


def _nonneg_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


def _pos_float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"expected a positive number, got {value!r}")
    return float(value)


def _size(value: object) -> int:
    size = parse_size(value)
    if size <= 0:
        raise ValueError(f"expected a positive size, got {value!r}")
    return size


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


# Fields of the lower tiers read by the store (its write policy), not by the tier's backend.
STORE_FIELDS = ("write_policy", "write_through_hits", "write_queue_blocks")


def _policy(value: object) -> str:
    if value not in WRITE_POLICIES:
        raise ValueError(f"expected one of {list(WRITE_POLICIES)}, got {value!r}")
    return str(value)


def _f(
    parse: Callable[[object], Any],
    default: Any = dataclasses.MISSING,
    *,
    secret: bool = False,
    required: bool = False,
) -> Any:
    """A config field: ``parse`` checks and converts the YAML value. Required in YAML when it
    has no default or ``required`` (a default for code that builds the config directly)."""
    return field(default=default, repr=not secret, metadata={"parse": parse, "required": required})
