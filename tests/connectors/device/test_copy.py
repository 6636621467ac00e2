"""SlabCopier's coalesced host -> cache copies (connectors/device/copy.py) against its
per-block copies, on the CPU (the same code path as CUDA, synchronous)."""

from __future__ import annotations

import pytest
import torch

from connectors.device import copy as offload_copy
from connectors.device.copy import SlabCopier
from connectors.device.slab_runs import MAX_SLOT_GAP, slot_runs
from engine.kv_cache import KVCache, KVCacheSpec

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)  # 2 KiB blocks
N = SPEC.bytes_per_block
SLOT = N + 48  # a 48-byte header before each payload, as host slots hold them


def test_slot_runs_split_at_every_change_of_stride() -> None:
    offs = [48, 48 + SLOT, 48 + 2 * SLOT, 48 + 5 * SLOT, 9, 48 + 7 * SLOT, 48 + 8 * SLOT]
    assert slot_runs(offs, N) == [(0, 3, SLOT), (3, 4, 0), (4, 5, 0), (5, 7, SLOT)]
    down = [48 + 4 * SLOT, 48 + 3 * SLOT, 48 + 2 * SLOT, 48 + 6 * SLOT]
    assert slot_runs(down, N) == [(0, 3, -SLOT), (3, 4, 0)]
    assert slot_runs([], N) == []
    assert slot_runs([16], N) == [(0, 1, 0)]
    # Overlapping payloads (stride < N), a gap past MAX_SLOT_GAP or an unaligned stride: no run.
    assert slot_runs([0, N - 8], N) == [(0, 1, 0), (1, 2, 0)]
    assert slot_runs([0, N + MAX_SLOT_GAP + 8], N) == [(0, 1, 0), (1, 2, 0)]
    assert slot_runs([0, N + 4], N) == [(0, 1, 0), (1, 2, 0)]


@pytest.mark.parametrize("staging_blocks", [64, 2])  # one chunk per run, or chunks of 2 blocks
def test_coalesced_copies_equal_per_block_copies(monkeypatch, staging_blocks: int) -> None:
    monkeypatch.setattr(offload_copy, "STAGING_BYTES", staging_blocks * SLOT)
    gen = torch.Generator().manual_seed(0)
    host = torch.randint(0, 256, (24 * SLOT,), generator=gen, dtype=torch.uint8)
    # Runs of 5 and 3 consecutive slots, two lone slots, a run written in reverse slot order.
    slots = [0, 1, 2, 3, 4, 9, 7, 12, 13, 14, 20, 19, 18]
    offsets = [s * SLOT + 48 for s in slots]
    block_ids = [17, 3, 8, 0, 25, 11, 4, 30, 29, 2, 6, 14, 21]
    expected = KVCache(SPEC, 32, "cpu")
    got = KVCache(SPEC, 32, "cpu")
    got.tensor.copy_(expected.tensor)
    SlabCopier(expected, host).to_device(block_ids, offsets)
    coalesced = SlabCopier(got, host, coalesce=True)
    assert not coalesced.coalesce  # CUDA only (a CPU memcpy per block is the faster path) ...
    coalesced.coalesce = True  # ... but the run path is the same code on the CPU
    coalesced.to_device(block_ids, offsets)
    assert coalesced._staging is not None  # the runs went through the staging buffer
    rows = got.tensor.reshape(32, -1).view(torch.uint8)  # bytes: random bits make NaNs
    assert torch.equal(rows, expected.tensor.reshape(32, -1).view(torch.uint8))
    for b, o in zip(block_ids, offsets, strict=True):  # and each block is its payload
        assert torch.equal(rows[b], host[o : o + N])
    untouched = sorted(set(range(32)) - set(block_ids))
    assert not rows[untouched].any()  # headers never land anywhere


def test_mismatched_lengths_raise() -> None:
    copier = SlabCopier(KVCache(SPEC, 4, "cpu"), torch.zeros(4 * SLOT, dtype=torch.uint8))
    with pytest.raises(ValueError, match="2 blocks for 1 offsets"):
        copier.to_device([0, 1], [48])
