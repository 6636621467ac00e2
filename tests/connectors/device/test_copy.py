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


def test_raw_layer_groups_cover_every_layer_once() -> None:
    """Layer-wise loads of raw blocks move ``layers_per_copy`` layers a copy (0: the default),
    the last group short when the count does not divide."""
    spec = KVCacheSpec(num_layers=6, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    cache = KVCache(spec, 4, "cpu")
    host = torch.zeros(4 * spec.bytes_per_block, dtype=torch.uint8)
    assert SlabCopier(cache, host, layers_per_copy=4).layer_groups() == [(0, 4), (4, 6)]
    assert SlabCopier(cache, host, layers_per_copy=1).layer_groups() == [
        (i, i + 1) for i in range(6)
    ]
    default = SlabCopier(cache, host).layer_groups()
    assert default == [(0, 6)]  # RAW_LAYERS_PER_COPY (16) >= 6 layers: one group
    assert not SlabCopier(cache, host, layered=True).layered  # CPU: no layer-wise loads


@pytest.mark.gpu
@pytest.mark.parametrize("per", [0, 1, 3])
def test_cuda_driver_copies_equal_torch_copies(per: int) -> None:
    """On CUDA, per-block copies through the driver and layer-wise ones (groups of ``per``
    layers, one event per layer, each layer's bytes in place once its event completed) land
    exactly what torch's per-block copies land, and nothing else."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from connectors.device.copy2d import copy_many_available

    if not copy_many_available():
        pytest.skip("no CUDA driver library")
    spec = KVCacheSpec(num_layers=5, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    n, slot, blocks = spec.bytes_per_block, spec.bytes_per_block + 48, 9
    gen = torch.Generator().manual_seed(1)
    host = torch.randint(0, 256, (blocks * slot,), generator=gen, dtype=torch.uint8)
    host = host.pin_memory()
    offsets = [s * slot + 48 for s in (3, 4, 5, 0, 8, 7, 1)]
    ids = [11, 2, 7, 30, 5, 19, 0]
    want = KVCache(spec, 32, "cuda")
    torch_path = SlabCopier(want, host)
    torch_path.use_driver = False
    torch_path.to_device(ids, offsets)
    per_block = KVCache(spec, 32, "cuda")
    SlabCopier(per_block, host).to_device(ids, offsets)
    layered_cache = KVCache(spec, 32, "cuda")
    layered = SlabCopier(layered_cache, host, layered=True, layers_per_copy=per)
    assert layered.layered and layered._driver_layers
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        events = layered.to_device_layers(ids, offsets)
    assert len(events) == spec.num_layers
    assert len(set(map(id, events))) == layered.load_stages == len(layered.layer_groups())
    torch.cuda.synchronize()
    expected = want.byte_rows()
    assert expected.any()
    for got in (per_block, layered_cache):
        assert torch.equal(got.byte_rows(), expected)
    for b, o in zip(ids, offsets, strict=True):
        assert torch.equal(expected[b].cpu(), host[o : o + n])
    with pytest.raises(ValueError, match="out of range"):
        SlabCopier(per_block, host).to_device([32], [48])
    with pytest.raises(ValueError, match="outside the host buffer"):
        SlabCopier(per_block, host).to_device([0], [blocks * slot - n + 1])
