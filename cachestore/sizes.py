"""Byte sizes as people write them in configs and flags: ``4GiB``, ``100GB``, ``512MiB``, ``1024``.

Decimal units (kB/KB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) powers of
1024; units are case-insensitive, a bare number is bytes. Bare ``K``/``M``/``G`` are refused as
ambiguous. Pure functions; torch-free.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Bytes in ``value``. Raises ValueError naming the value on anything unparseable.

    Fractions are allowed where the result is a whole number of bytes (``1.5GiB``); negative
    sizes and booleans are refused.
    """
    if isinstance(value, bool):
        raise ValueError(f"size must be a number of bytes or a string like '4GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be non-negative, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"size must be an int or a string like '4GiB', got {type(value).__name__}")
    match = _PATTERN.match(value)
    if match is None:
        raise ValueError(f"cannot parse size {value!r}; write e.g. 4GiB, 100GB, 512MiB or 1024")
    number, unit = match.groups()
    scale = _UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(f"unknown size unit {unit!r} in {value!r}; use one of "
                         "B, KB, MB, GB, TB (x1000) or KiB, MiB, GiB, TiB (x1024)")
    try:
        total = Decimal(number) * scale
    except InvalidOperation:
        raise ValueError(f"cannot parse size {value!r}") from None
    if total != total.to_integral_value():
        raise ValueError(f"size {value!r} is not a whole number of bytes")
    return int(total)


def format_size(num_bytes: int) -> str:
    """Shortest exact binary rendering: 4294967296 -> '4GiB', 1000 -> '1000B'."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if num_bytes >= scale and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return f"{num_bytes}B"
