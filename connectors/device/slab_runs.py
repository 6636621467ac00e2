"""Runs of host-slab slots at a constant stride: what lets a load move many blocks with one
copy (a span, or one 2-D copy per part of a payload)."""

from __future__ import annotations

from collections.abc import Sequence

from cachestore.kv_format import pad16

__all__ = ["MAX_SLOT_GAP", "ascending_runs", "check_payloads", "pad16", "slot_runs"]

MAX_SLOT_GAP = 64 << 10  # slot bytes besides the payload a run may carry along (headers, pad)


def slot_runs(offsets: Sequence[int], nbytes: int) -> list[tuple[int, int, int]]:
    """Maximal runs ``[start, end)`` of ``offsets`` at one constant ``stride`` (returned as
    ``(start, end, stride)``; a single offset is a run of one with stride 0) where a run of
    two or more has ``nbytes <= |stride| <= nbytes + MAX_SLOT_GAP`` and 8-byte aligned offsets
    and stride, so its span can be copied whole and its payloads taken as 8-byte words. A
    negative stride is a run in descending slot order: the saver writes a freed prefix tail
    first (the block pool frees a request's blocks last to first), so that is the usual one."""
    runs: list[tuple[int, int, int]] = []
    i = 0
    while i < len(offsets):
        j = i + 1
        stride = offsets[j] - offsets[i] if j < len(offsets) else 0
        if (
            nbytes <= abs(stride) <= nbytes + MAX_SLOT_GAP
            and stride % 8 == 0
            and offsets[i] % 8 == 0
        ):
            while j < len(offsets) and offsets[j] - offsets[j - 1] == stride:
                j += 1
        else:
            stride = 0
        runs.append((i, j, stride))
        i = j
    return runs


def ascending_runs(offsets: Sequence[int], nbytes: int) -> list[tuple[int, int, list[int]]]:
    """``slot_runs`` in address order within each run: ``(lowest offset, pitch, indices into
    offsets from that one up)``; a run of one has pitch ``nbytes``."""
    out: list[tuple[int, int, list[int]]] = []
    for start, end, stride in slot_runs(offsets, nbytes):
        if stride >= 0:
            out.append((offsets[start], stride or nbytes, list(range(start, end))))
        else:  # descending slots: the run starts at its last block's payload
            out.append((offsets[end - 1], -stride, list(range(end - 1, start - 1, -1))))
    return out


def check_payloads(
    block_ids: Sequence[int], offsets: Sequence[int], num_blocks: int, nbytes: int, host_bytes: int
) -> None:
    """Raises ValueError unless every ``block_ids[i]`` is a row of a ``num_blocks``-row cache
    and every payload of ``nbytes`` at ``offsets[i]`` lies inside a ``host_bytes`` slab (one
    offset per block)."""
    if len(block_ids) != len(offsets):
        raise ValueError(f"{len(block_ids)} blocks for {len(offsets)} offsets")
    if block_ids and (min(block_ids) < 0 or max(block_ids) >= num_blocks):
        raise ValueError(f"block id out of range [0, {num_blocks})")
    if offsets and (min(offsets) < 0 or max(offsets) + nbytes > host_bytes):
        raise ValueError("a payload runs outside the host buffer")
