"""The S3 tier's object layout: group manifests (pointers) and the chain walk that reads them.

A *group* object holds up to ``blocks_per_object`` values concatenated; every key of the group
has a *pointer* object carrying the group's whole manifest (msgpack ``{"g": group object name,
"k": [keys], "o": [offsets], "n": [lengths]}``), so reading ONE pointer locates every key of its
group. This module is pure: it builds, parses and trims manifests and resolves a chain of keys
given a function that fetches pointers; ``tiers.s3`` does the I/O. Thread-safe (no state).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

import msgpack

from tiers.base import Value
from tiers.shared import nbytes


@dataclass(frozen=True, slots=True)
class Pointer:
    group: str
    keys: tuple[str, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @classmethod
    def for_group(cls, group: str, chunk: Sequence[tuple[str, Value]]) -> Pointer:
        """The manifest of ``chunk``'s values concatenated in order into object ``group``."""
        offsets, lengths, pos = [], [], 0
        for _, value in chunk:
            n = nbytes(value)
            offsets.append(pos)
            lengths.append(n)
            pos += n
        return cls(group, tuple(k for k, _ in chunk), tuple(offsets), tuple(lengths))

    def pack(self) -> bytes:
        packed: bytes = msgpack.packb(
            {"g": self.group, "k": list(self.keys), "o": list(self.offsets),
             "n": list(self.lengths)})  # fmt: skip
        return packed

    @classmethod
    def unpack(cls, raw: bytes) -> Pointer | None:
        """The pointer in ``raw``; None for a damaged one (a miss, like a damaged block)."""
        try:
            m = msgpack.unpackb(raw)
            return cls(m["g"], tuple(m["k"]), tuple(m["o"]), tuple(m["n"]))
        except (ValueError, KeyError, TypeError, msgpack.UnpackException):
            return None

    def without(self, gone: Container[str]) -> Pointer:
        """This manifest with the keys in ``gone`` left out (after they were deleted)."""
        keep = [j for j, k in enumerate(self.keys) if k not in gone]
        return Pointer(self.group, tuple(self.keys[j] for j in keep),
                       tuple(self.offsets[j] for j in keep),
                       tuple(self.lengths[j] for j in keep))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Location:
    group: str
    offset: int
    length: int


def resolve(
    keys: Sequence[str],
    read_pointers: Callable[[list[str]], list[Pointer | None]],
    blocks_per_object: int,
    fanout: int,
    stop_at_miss: bool,
) -> list[Location | None]:
    """Locations of ``keys`` (all of them, or the leading run when ``stop_at_miss``).

    Each round fetches (``read_pointers``, in parallel) the pointers of the next unresolved key
    and of the keys ``blocks_per_object`` apart after it, at most ``fanout`` of them: where the
    next groups start if the chain was written in one call. A manifest then resolves the keys it
    lists in the same order. Raises what ``read_pointers`` raises.
    """
    out: list[Location | None] = [None] * len(keys)
    i = 0
    while i < len(keys):
        probes = list(range(i, len(keys), blocks_per_object))[:fanout]
        found = read_pointers([keys[p] for p in probes])
        pointers = dict(zip(probes, found, strict=True))
        while i < len(keys) and i in pointers:
            ptr = pointers[i]
            if ptr is None or keys[i] not in ptr.keys:
                if stop_at_miss:
                    return out[:i]
                i += 1
                continue
            j = ptr.keys.index(keys[i])
            while i < len(keys) and j < len(ptr.keys) and ptr.keys[j] == keys[i]:
                out[i] = Location(ptr.group, ptr.offsets[j], ptr.lengths[j])
                i, j = i + 1, j + 1
    return out
