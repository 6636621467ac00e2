"""Sizes as people write them in configs and flags: the one grammar for every YAML field, every
CLI flag and ``kvtier analyze``. Torch-free pure functions.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

# Sizes as people write them in configs and flags; the one grammar for every YAML field, every
# CLI flag and ``kvtier analyze``. A number always carries a unit, because a bare one meant bytes
# in some places and blocks in others:
#   bytes   ``4GiB``, ``512MiB``, ``100GB``, ``4096B``; a lone prefix is bytes too: ``G`` (and
#           ``k``/``M``/``T``/``P``) is decimal (10^9), ``Gi`` binary (2^30), as in Kubernetes;
#   blocks  ``1000blocks`` / ``1000 blocks``; tokens ``3Mtok``, ``500ktok``, ``1Mitok``, ``3M tokens``;
#   ``inf`` unbounded.
# Units are case-insensitive. Which kinds a field takes is the caller's choice (``accept``);
# pure functions.
BYTES, BLOCKS, TOKENS, UNBOUNDED = "bytes", "blocks", "tokens", "inf"
_PREFIXES: dict[str, int] = {
    "": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
    "p": 1000**5,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
    "pi": 1024**5,
}
_UNIT_WORDS: dict[str, str] = {
    "": BYTES,
    "b": BYTES,
    "byte": BYTES,
    "bytes": BYTES,
    "block": BLOCKS,
    "blocks": BLOCKS,
    "tok": TOKENS,
    "token": TOKENS,
    "tokens": TOKENS,
}
_NUMBER = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(.*?)\s*$")
_EXAMPLES: dict[str, str] = {
    BYTES: "bytes as 4GiB, 512MiB, 100GB or 4096B (Gi/GiB = 2^30, G/GB = 10^9)",
    BLOCKS: "blocks as 1000blocks",
    TOKENS: "tokens as 3Mtok",
    UNBOUNDED: "inf for unbounded",
}


@dataclass(frozen=True, slots=True)
class Size:
    """One parsed size: ``amount`` of ``unit`` (BYTES, BLOCKS or TOKENS), or UNBOUNDED with
    ``amount`` None. ``text`` is what the user wrote (for labels and errors)."""

    unit: str
    amount: int | None
    text: str


def _split_unit(suffix: str) -> tuple[int, str] | None:
    """``"GiB"`` -> (2^30, BYTES), ``"Mtok"`` -> (10^6, TOKENS), ``"G"`` -> (10^9, BYTES); None
    if it is no unit. A whole unit word wins over a prefix (``tok`` is tokens, not tera-``ok``)."""
    s = suffix.lower()
    for plen in (0, 2, 1):
        prefix, word = s[:plen], s[plen:].strip()
        if prefix in _PREFIXES and word in _UNIT_WORDS and (plen or word):
            return _PREFIXES[prefix], _UNIT_WORDS[word]
    return None


def _examples(accept: Collection[str]) -> str:
    return "; ".join(_EXAMPLES[k] for k in (BYTES, BLOCKS, TOKENS, UNBOUNDED) if k in accept)


def parse_quantity(value: object, what: str = "", accept: Collection[str] = (BYTES,)) -> Size:
    """``value`` (a string with a unit, see above) -> Size. ``what`` (a field or flag name)
    starts every error; ``accept`` lists the kinds this caller can use. Raises ValueError (one
    line naming the value, with examples of what is accepted) on a bare number, an unknown
    unit, a fraction of a byte/block/token, a negative value or a kind not in ``accept``."""

    def fail(msg: str) -> ValueError:
        return ValueError(f"{what}: {msg}" if what else msg)

    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise fail(f"expected a size like '4GiB', got {value!r} ({type(value).__name__})")
    text = str(value)
    if text.strip().startswith("-"):
        raise fail(f"{value!r} is negative; sizes are zero or more")
    if text.strip().lower() in ("inf", "unbounded"):
        if UNBOUNDED not in accept:
            raise fail(f"{value!r} (unbounded) is not allowed here; write {_examples(accept)}")
        return Size(UNBOUNDED, None, text.strip())
    match = _NUMBER.match(text)
    if match is None:
        raise fail(f"cannot parse size {value!r}; write {_examples(accept)}")
    number, suffix = match.groups()
    if not suffix:
        raise fail(f"{value!r} has no unit; write {_examples(accept)}")
    unit = _split_unit(suffix)
    if unit is None:
        raise fail(f"unknown unit {suffix!r} in {value!r}; write {_examples(accept)}")
    scale, kind = unit
    if kind not in accept:
        raise fail(
            f"{value!r} is in {kind}, which this setting does not take; write {_examples(accept)}"
        )
    try:
        total = Decimal(number) * scale
    except InvalidOperation:
        raise fail(f"cannot parse size {value!r}") from None
    if total != total.to_integral_value():
        raise fail(f"{value!r} is not a whole number of {kind}")
    return Size(kind, int(total), text.strip())


def parse_size(value: object, what: str = "") -> int:
    """Bytes in ``value`` (``4GiB``, ``100GB``, ``4G`` = 4*10^9, ``4Gi`` = 4*2^30, ``4096B``).
    Raises ValueError naming ``what`` and the value on a bare number, blocks, tokens, ``inf``
    or anything unparseable."""
    size = parse_quantity(value, what, (BYTES,))
    assert size.amount is not None
    return size.amount


def format_size(num_bytes: int) -> str:
    """Shortest exact binary rendering: 4294967296 -> '4GiB', 1000 -> '1000B'."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if num_bytes >= scale and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return f"{num_bytes}B"


_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def config_size(num_bytes: int) -> str:
    """For a start-up line, in the config's own syntax: ``format_size``'s exact form when whole
    in the largest unit reached ('8GiB'), else that unit to one decimal ('~5.7GiB')."""
    for unit, scale in _UNITS:
        if num_bytes >= scale:
            exact = format_size(num_bytes)
            return exact if exact.endswith(unit) else f"~{num_bytes / scale:.1f}{unit}"
    return format_size(num_bytes)


def approx_size(num_bytes: int) -> str:
    """For a log or error sentence: the largest unit reached, one decimal ('15.0 GiB',
    '3.0 MiB', '512 B')."""
    for unit, scale in _UNITS:
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"
