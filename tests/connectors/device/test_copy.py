"""SlabCopier's coalesced and staged layer-wise host -> cache copies (connectors/device/copy.py,
raw_layers.py) against its per-block copies, on the CPU (the same code paths as CUDA,
synchronous)."""

from __future__ import annotations

import pytest
import torch

from connectors.device import copy as offload_copy
from connectors.device import raw_layers
from connectors.device.copy import SlabCopier
from connectors.device.copy2d import copy2d
from connectors.device.slab_runs import MAX_SLOT_GAP, ascending_runs, slot_runs
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
    """On CUDA, per-block copies through the driver and layer-wise ones by per-block driver
    copies (``staged_layers`` False; groups of ``per`` layers, one event per layer, each layer's bytes in place once its event completed) land
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
    layered.staged_layers = False  # the per-block driver copies (the staged path: below)
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


# Staged layer-wise loads of raw blocks (raw_layers.StagedLayers): 10 layers of 4 KiB, so a
# slot gap of 64 KiB (MAX_SLOT_GAP) spans under 3 slots and slots 3 or more apart are no run.
LAYERED_SPEC = KVCacheSpec(num_layers=10, num_kv_heads=2, head_dim=16, dtype=torch.float32)
N_LAYERED = LAYERED_SPEC.bytes_per_block
HEADER = 64  # bytes before each payload in a slot, as the host tier's codec header
LAYOUTS = {
    "ascending": [3, 4, 5, 6, 7, 8, 9, 10],
    "descending": [12, 11, 10, 9, 8, 7, 6, 5],  # a prefix saved tail first
    "shuffled": [9, 0, 4, 12, 1, 7, 15, 11],  # runs of one
    "mixed": [0, 1, 2, 9, 8, 7, 13, 4],  # up 3, down 3, two alone
}
LAYER_IDS = [17, 3, 8, 0, 22, 11, 4, 30]  # not consecutive; the other rows stay untouched


def layered_slab(
    spec: KVCacheSpec, slots: list[int], device: str = "cpu"
) -> tuple[KVCache, torch.Tensor, list[int], torch.Tensor]:
    """A cache of 32 blocks holding random bytes, a slab of random bytes (headers included)
    with the payloads at ``slots``, their offsets, and the cache rows per-block ``copy_``s
    of them into ``LAYER_IDS`` land (the reference)."""
    n = spec.bytes_per_block
    slot = n + HEADER
    gen = torch.Generator().manual_seed(len(slots) + slots[0])
    host = torch.randint(0, 256, ((max(slots) + 1) * slot,), generator=gen, dtype=torch.uint8)
    offsets = [s * slot + HEADER for s in slots]
    cache = KVCache(spec, 32, device)
    rows = cache.byte_rows()
    rows.copy_(torch.randint(0, 256, tuple(rows.shape), generator=gen, dtype=torch.uint8))
    want = rows.cpu().clone()
    for b, o in zip(LAYER_IDS, offsets, strict=True):
        want[b].copy_(host[o : o + n])
    return cache, host, offsets, want


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize(
    ("per", "groups"),
    [
        (1, [(i, i + 1) for i in range(10)]),
        (3, [(0, 3), (3, 6), (6, 9), (9, 10)]),  # the last group short
        (0, [(0, 4), (4, 8), (8, 10)]),  # automatic: STAGED_LAYERS_PER_COPY (4)
    ],
)
@pytest.mark.parametrize("small_buffers", [False, True])
def test_staged_layer_copies_equal_per_block_copies(
    monkeypatch: pytest.MonkeyPatch,
    layout: str,
    per: int,
    groups: list[tuple[int, int]],
    small_buffers: bool,
) -> None:
    """Layer-wise loads of raw blocks through the staging buffers (one 2-D copy per run of
    slots and group of layers, then a word scatter) land exactly what per-block copies land,
    whatever the slots' order, and nothing else. ``small_buffers``: staging buffers of one
    block, so a group's rows go in several chunks (3 rows of 3 layers, 1 row of 8), cutting
    runs."""
    if small_buffers:
        monkeypatch.setattr(raw_layers, "LAYER_BYTES", 1)
    slots = LAYOUTS[layout]
    cache, host, offsets, want = layered_slab(LAYERED_SPEC, slots)
    if layout == "shuffled":
        assert all(len(js) == 1 for _, _, js in ascending_runs(offsets, N_LAYERED))
    copies: list[tuple[object, ...]] = []

    def counted(*args: object) -> None:
        copies.append(args)
        copy2d(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(raw_layers, "copy2d", counted)
    copier = SlabCopier(cache, host, layered=True, layers_per_copy=per, force_layers=True)
    assert copier.layered and copier._staged is not None
    assert copier.layer_groups() == groups and copier.load_stages == len(groups)
    assert copier.to_device_layers(LAYER_IDS, offsets) == []  # CPU: done on return
    if not small_buffers:  # one 2-D copy per run of slots and group of layers
        assert len(copies) == len(ascending_runs(offsets, N_LAYERED)) * len(groups)
    staging = copier._staged._staging
    assert staging is not None
    assert staging.numel() == 2 * (N_LAYERED if small_buffers else raw_layers.LAYER_BYTES)
    assert torch.equal(cache.byte_rows(), want)


@pytest.mark.parametrize(("per", "ahead"), [(3, 1), (3, 4), (1, 2), (0, 9), (0, 30)])
@pytest.mark.parametrize("small_buffers", [False, True])
def test_staged_layer_copies_issued_on_demand_land_group_by_group(
    monkeypatch: pytest.MonkeyPatch, per: int, ahead: int, small_buffers: bool
) -> None:
    """``issue_ahead``: the load issues only the groups its first layer and the look-ahead
    need; each ``ensure(layer)`` (what the forward calls before it waits for a layer) issues
    every group up to ``layer + ahead`` and no further; ``finish`` the rest. At every point
    the layers issued hold the loaded bytes and the others are untouched; in the end the
    cache equals the eager path's, with as many 2-D copies."""
    if small_buffers:
        monkeypatch.setattr(raw_layers, "LAYER_BYTES", 1)
    copies: list[object] = []

    def counted(*args: object) -> None:
        copies.append(args)
        copy2d(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(raw_layers, "copy2d", counted)
    cache, host, offsets, want = layered_slab(LAYERED_SPEC, LAYOUTS["mixed"])
    start = cache.byte_rows().clone()
    per_layer = N_LAYERED // LAYERED_SPEC.num_layers
    copier = SlabCopier(
        cache, host, layered=True, layers_per_copy=per, force_layers=True, issue_ahead=ahead
    )
    groups = copier.layer_groups()
    last = LAYERED_SPEC.num_layers - 1

    def landed_through() -> int:
        """The last layer whose bytes are loaded; every layer after it must be untouched."""
        rows = cache.byte_rows()
        done = -1
        for layer in range(LAYERED_SPEC.num_layers):
            cols = slice(layer * per_layer, (layer + 1) * per_layer)
            if torch.equal(rows[:, cols], want[:, cols]):
                assert done == layer - 1, f"layer {layer} landed after a gap"
                done = layer
            else:
                assert torch.equal(rows[:, cols], start[:, cols]), f"layer {layer} half done"
        return done

    def group_end(layer: int) -> int:  # the last layer of the group holding ``layer``
        return next(b - 1 for a, b in groups if a <= layer < b)

    events = copier.to_device_layers(LAYER_IDS, offsets)
    assert events == []  # CPU: no events, the groups issued are done on return
    assert landed_through() == group_end(min(ahead, last))
    for layer in range(LAYERED_SPEC.num_layers):
        events.ensure(layer)  # type: ignore[attr-defined]
        assert landed_through() == group_end(min(layer + ahead, last))
    events.finish()  # type: ignore[attr-defined]
    events.finish()  # type: ignore[attr-defined]  # idempotent
    assert torch.equal(cache.byte_rows(), want)
    eager_copies = len(copies)
    copies.clear()
    cache.byte_rows().copy_(start)
    SlabCopier(cache, host, layered=True, layers_per_copy=per, force_layers=True).to_device_layers(
        LAYER_IDS, offsets
    )
    assert len(copies) == eager_copies and torch.equal(cache.byte_rows(), want)
    with pytest.raises(ValueError, match="issue_ahead must be >= 0"):
        SlabCopier(cache, host, layered=True, force_layers=True, issue_ahead=-1)


def test_layer_reads_issue_their_copies_before_they_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVCache.set_layer_ready(events, ensure)``: a read of layer ``i`` calls ``ensure(i)``
    before its stream waits for event ``i`` (a wait for an event not yet recorded would not
    hold the read back); ``clear_layer_ready`` and ``wait_all_layers`` ensure the last layer,
    so every copy is issued once the forward is queued. Without ``ensure``, reads only wait."""
    calls: list[tuple[str, object]] = []

    class Stream:
        def wait_event(self, event: object) -> None:
            calls.append(("wait", event))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    spec = LAYERED_SPEC
    cache = KVCache(spec, 4, "cpu")
    events = [f"e{i}" for i in range(spec.num_layers)]
    cache.set_layer_ready(events, lambda layer: calls.append(("ensure", layer)))
    cache.attention_view(0)
    cache.attention_view(1)
    assert calls == [("ensure", 0), ("wait", "e0"), ("ensure", 1), ("wait", "e1")]
    calls.clear()
    cache.clear_layer_ready()
    assert calls == [("ensure", spec.num_layers - 1)]
    calls.clear()
    cache.attention_view(2)  # cleared: no wait, no ensure
    assert calls == []
    cache.set_layer_ready(events, lambda layer: calls.append(("ensure", layer)))
    cache.wait_all_layers()
    assert calls == [("ensure", spec.num_layers - 1), ("wait", events[-1])]
    calls.clear()
    cache.clear_layer_ready()
    cache.set_layer_ready(events)
    cache.attention_view(3)
    cache.clear_layer_ready()
    assert calls == [("wait", "e3")]


def test_staged_layer_copies_refuse_what_would_leave_their_bounds() -> None:
    """A block id outside the cache or a payload outside the slab is a ValueError before
    anything is copied; layers that are not whole 8-byte words get no staged path; without
    ``force_layers`` a CPU copier has none either."""
    cache, host, offsets, _ = layered_slab(LAYERED_SPEC, LAYOUTS["ascending"])
    before = cache.byte_rows().clone()
    copier = SlabCopier(cache, host, layered=True, force_layers=True)
    with pytest.raises(ValueError, match="block id out of range"):
        copier.to_device_layers([*LAYER_IDS[:-1], 32], offsets)
    with pytest.raises(ValueError, match="block id out of range"):
        copier.to_device_layers([-1, *LAYER_IDS[1:]], offsets)
    with pytest.raises(ValueError, match="outside the host buffer"):
        copier.to_device_layers(LAYER_IDS, [*offsets[:-1], host.numel() - N_LAYERED + 1])
    with pytest.raises(ValueError, match="8 blocks for 7 offsets"):
        copier.to_device_layers(LAYER_IDS, offsets[:-1])
    assert torch.equal(cache.byte_rows(), before)
    assert copier.to_device_layers([], []) == []
    assert not SlabCopier(cache, host, layered=True).layered  # CPU: no layer-wise loads
    odd = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=1, dtype=torch.float16, block_size=1)
    odd_cache = KVCache(odd, 4, "cpu")  # 4 bytes a layer
    odd_host = torch.zeros(4 * odd.bytes_per_block, dtype=torch.uint8)
    staged = SlabCopier(odd_cache, odd_host, layered=True, force_layers=True)
    assert not staged.layered and staged._staged is None
    with pytest.raises(ValueError, match="layers_per_copy must be >= 0"):
        SlabCopier(cache, host, layered=True, force_layers=True, layers_per_copy=-1)


def _skip_without_2d_copies() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from connectors.device.copy2d import copy2d_available

    if not copy2d_available():
        pytest.skip("no CUDA driver library")


def _load_on_side_stream(copier: SlabCopier, offsets: list[int]) -> list[object]:
    """``to_device_layers`` of ``LAYER_IDS`` on a side stream, after the cache's random fill."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        side.wait_stream(torch.cuda.default_stream())
        return copier.to_device_layers(LAYER_IDS, offsets)


def _assert_whole_block_fallback(
    copier: SlabCopier, offsets: list[int], cache: KVCache, want: torch.Tensor
) -> None:
    """The load lands whole (one event for every layer, the same bytes) and the copier loads
    whole blocks from then on."""
    events = _load_on_side_stream(copier, offsets)
    assert len(events) == LAYERED_SPEC.num_layers and len(set(map(id, events))) == 1
    torch.cuda.synchronize()
    assert torch.equal(cache.byte_rows().cpu(), want) and not copier.layered


@pytest.mark.gpu
@pytest.mark.parametrize("refuse_at", [None, 2])
def test_cuda_staged_layer_copies_issued_on_demand(
    monkeypatch: pytest.MonkeyPatch, refuse_at: int | None
) -> None:
    """On CUDA with ``issue_ahead``: one event per group, made at the load; a group's event is
    recorded when ``ensure`` issues it (before, an event was never recorded: the groups past
    the look-ahead have none yet, whose ``query`` would read done); after ``finish`` the cache
    holds exactly the loaded bytes. A 2-D copy refused at group ``refuse_at``: the load ends in
    whole blocks and every event left is recorded after them."""
    _skip_without_2d_copies()
    monkeypatch.setattr(raw_layers, "LAYER_BYTES", 1)
    cache, host, offsets, want = layered_slab(LAYERED_SPEC, LAYOUTS["mixed"], "cuda")
    host = host.pin_memory()
    copier = SlabCopier(cache, host, layered=True, layers_per_copy=3, issue_ahead=1)
    groups = copier.layer_groups()  # (0, 3), (3, 6), (6, 9), (9, 10)
    if refuse_at is not None:
        real = raw_layers.StagedLayers._copy_group

        def refusing(self: object, *args: object) -> object:
            if args[4] == groups[refuse_at]:  # the group's (first) 2-D copy refused
                raise RuntimeError("cuMemcpy2DAsync failed with CUresult 1")
            return real(self, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(raw_layers.StagedLayers, "_copy_group", refusing)
    events = _load_on_side_stream(copier, offsets)
    assert len(events) == LAYERED_SPEC.num_layers
    assert len({id(e) for e in events}) == len(groups)
    events.ensure(0)  # type: ignore[attr-defined]
    events.ensure(5)  # type: ignore[attr-defined]
    events.finish()  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    assert all(e.query() for e in events)  # type: ignore[attr-defined]
    assert torch.equal(cache.byte_rows().cpu(), want)
    if refuse_at is not None:
        assert not copier.layered  # whole blocks from then on


@pytest.mark.gpu
@pytest.mark.parametrize("per", [0, 1, 3])
@pytest.mark.parametrize("layout", ["descending", "mixed"])
def test_cuda_staged_layer_copies_equal_torch_copies(
    monkeypatch: pytest.MonkeyPatch, per: int, layout: str
) -> None:
    """On CUDA, ``SlabCopier(layered=True)`` over a pinned slab takes the staged path (driver
    2-D copies on the side stream, the scatter on a second one; staging buffers of one block,
    so groups go in several chunks through both buffers in turn): one event per layer, one
    distinct event per group, and once the last completed the cache holds exactly what torch's
    per-block copies land. A 2-D copy the driver refuses: whole blocks, one event for every
    layer, and no more layer-wise loads on that copier."""
    _skip_without_2d_copies()
    monkeypatch.setattr(raw_layers, "LAYER_BYTES", 1)
    cache, host, offsets, want = layered_slab(LAYERED_SPEC, LAYOUTS[layout], "cuda")
    host = host.pin_memory()
    start = cache.byte_rows().clone()
    copier = SlabCopier(cache, host, layered=True, layers_per_copy=per)
    assert copier.layered and copier._staged is not None
    events = _load_on_side_stream(copier, offsets)
    cuda_events = [e for e in events if isinstance(e, torch.cuda.Event)]
    assert len(cuda_events) == len(events) == LAYERED_SPEC.num_layers
    assert len(set(map(id, events))) == copier.load_stages == len(copier.layer_groups())
    cuda_events[-1].synchronize()
    assert all(e.query() for e in cuda_events)
    assert torch.equal(cache.byte_rows().cpu(), want)

    def refused(*args: object) -> None:
        raise RuntimeError("cuMemcpy2DAsync failed with CUresult 1")

    cache.byte_rows().copy_(start)
    monkeypatch.setattr(raw_layers, "copy2d", refused)
    _assert_whole_block_fallback(copier, offsets, cache, want)


@pytest.mark.gpu
def test_cuda_staged_layer_copies_without_memory_for_the_staging_load_whole_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Staging buffers the device cannot hold (CUDA out of memory): the load lands whole, one
    event for every layer, the same bytes, and the copier loads whole blocks from then on."""
    _skip_without_2d_copies()
    monkeypatch.setattr(raw_layers, "LAYER_BYTES", 1 << 50)
    cache, host, offsets, want = layered_slab(LAYERED_SPEC, LAYOUTS["mixed"], "cuda")
    copier = SlabCopier(cache, host.pin_memory(), layered=True)
    _assert_whole_block_fallback(copier, offsets, cache, want)
