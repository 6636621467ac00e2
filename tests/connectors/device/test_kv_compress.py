"""``compression: lossless`` (connectors/device/kv_compress.py): the 12-bit block format gives back
every byte (torch and Triton decoders alike), says when a block cannot be stored, and an
engine storing compressed blocks produces the same greedy outputs as one without offload,
across the host tier, LMDB and a restart, without ever reading another format's blocks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import (CPU kernels)

from connectors.device.copy import SlabCopier  # noqa: E402
from connectors.device.kv_compress import DecodeBases, Hi4Codec  # noqa: E402
from connectors.device.slab_runs import pad16  # noqa: E402
from connectors.offload.config import parse_offload_config  # noqa: E402
from engine import LLM  # noqa: E402
from engine.kv_cache import KVCache, KVCacheSpec  # noqa: E402
from tests.connectors.offload.test_connector import run_conversations  # noqa: E402
from tiers.config import ConfigError  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton decoder runs


def kv_like(n: int, codec: Hi4Codec, seed: int = 0) -> torch.Tensor:
    """``n`` whole blocks of bf16 values shaped like KV (Gaussian, per-segment scales from
    1e-3 to 30) plus the awkward ones: zeros of both signs, inf, nan, subnormals."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 1.5, codec.num_segments)[
        torch.randperm(codec.num_segments, generator=gen)
    ]
    x = torch.randn(n, codec.num_segments, codec.segment_values, generator=gen) * scale[:, None]
    flat = x.view(n, -1)
    flat[0, :6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40])
    return flat.bfloat16().view(torch.uint8).view(n, -1)


def test_round_trip_is_exact_and_smaller() -> None:
    codec = Hi4Codec(8, 2048)
    rows = kv_like(5, codec)
    enc = codec.encode(rows)
    assert enc.shape == (5, codec.payload_bytes)
    assert codec.payload_bytes < 0.78 * codec.raw_bytes
    assert not any(codec.overflowed(memoryview(e.numpy())) for e in enc)
    src = torch.cat([torch.zeros(32, dtype=torch.uint8), enc.reshape(-1)])  # offsets not 0
    cache = torch.zeros(9, codec.raw_bytes, dtype=torch.uint8)
    ids = [7, 0, 4, 2, 8]
    codec.decode_into(src, [32 + i * codec.payload_bytes for i in range(5)], cache, ids)
    for i, b in enumerate(ids):
        assert torch.equal(cache[b], rows[i])
    assert cache[[1, 3, 5, 6]].eq(0).all()  # nothing else written


def test_triton_decoder_matches_torch() -> None:
    pytest.importorskip("triton")
    from engine.kernels.kv_unpack import decode_hi4

    codec = Hi4Codec(4, 768)  # not a multiple of the kernel's tile
    rows = kv_like(3, codec, seed=1)
    rows[1, :40] = 0
    seg = rows.view(3, 4, 768, 2)[2, 1]
    seg[:, 1] = torch.where(torch.arange(768) % 2 == 0, 0x3F, 0xBF)  # two high bytes...
    seg[::37, 1] = torch.arange(0x60, 0x60 + 21, dtype=torch.uint8)  # ...and 21 once each
    enc = codec.encode(rows)
    assert int(enc[2, 2]) | int(enc[2, 3]) << 8 == 23 - 15  # 15 in the book, 8 escaped
    src = enc.reshape(-1)
    offs = [i * codec.payload_bytes for i in range(3)]
    a = torch.zeros(4, codec.raw_bytes, dtype=torch.uint8)
    b = torch.zeros(4, codec.raw_bytes, dtype=torch.uint8, device=DEVICE)
    codec.decode_into(src, offs, a, [3, 1, 0])  # CPU: the torch path
    index = codec.decode_index(codec.payload_bases(offs), [3, 1, 0], DEVICE)
    decode_hi4(codec, src.to(DEVICE), index, b, 0, codec.num_segments)
    assert torch.equal(a, b.cpu())
    assert torch.equal(a[3], rows[0]) and torch.equal(a[1], rows[1]) and torch.equal(a[0], rows[2])


def test_overflow_is_reported_and_a_damaged_index_stays_in_its_segment() -> None:
    codec = Hi4Codec(2, 1024)  # 8 escapes a segment
    rows = kv_like(1, codec)
    spread = torch.logspace(-30, 30, 1024).bfloat16()  # ~50 distinct high bytes
    rows.view(1, 2, 1024, 2)[0, 1] = spread.view(torch.uint8).view(1024, 2)
    enc = codec.encode(rows)
    assert codec.overflowed(memoryview(enc[0].numpy()))
    ok = codec.encode(kv_like(1, codec, seed=3))
    assert not codec.overflowed(memoryview(ok[0].numpy()))
    # An escape index past the segment (a damaged payload) is ignored, not written elsewhere.
    off = codec.offsets
    bad = ok.clone()
    bad[0, 0:2] = torch.tensor([1, 0], dtype=torch.uint8)  # segment 0: one escape...
    bad[0, off["idx"] : off["idx"] + 2] = torch.tensor([0xFF, 0xFF], dtype=torch.uint8)  # at 65535
    cache = torch.zeros(2, codec.raw_bytes, dtype=torch.uint8)
    codec.decode_into(bad.reshape(-1), [0], cache, [0])
    assert cache[1].eq(0).all()
    with pytest.raises(ValueError, match="block id"):
        codec.decode_into(ok.reshape(-1), [0], cache, [2])
    with pytest.raises(ValueError, match="past the end"):
        codec.decode_into(ok.reshape(-1), [8], cache, [0])


def test_codec_needs_a_two_byte_cache_and_config_names_its_choices() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    with pytest.raises(
        ValueError, match="compression: lossless needs a 2-byte KV dtype .* --dtype bfloat16"
    ):
        Hi4Codec.for_cache(KVCache(spec, 4, "cpu"))
    bf16 = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    codec = Hi4Codec.for_cache(KVCache(bf16, 4, "cpu"))
    assert (codec.num_segments, codec.segment_values) == (4, 16 * 2 * 8)
    with pytest.raises(ConfigError, match="compression"):
        parse_offload_config(
            {"tiers": [{"kind": "host", "capacity": "1MiB"}], "compression": "zstd"}
        )
    cfg = parse_offload_config(
        {"tiers": [{"kind": "host", "capacity": "1MiB"}], "compression": "lossless"}
    )
    assert cfg.compression == "lossless"


def test_slab_copier_round_trips_encoded_blocks_in_any_slot_order() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    cache = KVCache(spec, 8, "cpu")
    codec = Hi4Codec.for_cache(cache)
    cache.tensor.copy_(kv_like(8, codec).view(torch.bfloat16).view_as(cache.tensor))
    before = cache.tensor.clone()
    stride = codec.payload_bytes + 48
    host = torch.zeros(8 * stride, dtype=torch.uint8)
    copier = SlabCopier(cache, host, codec=codec)
    assert copier.nbytes == codec.payload_bytes and not copier.layered
    slots = [5, 4, 3, 0, 7, 1]  # a descending run, then scattered slots
    copier.to_host([0, 1, 2, 3, 4, 5], [s * stride + 16 for s in slots])
    cache.tensor.zero_()
    copier.to_device([2, 0, 1, 5, 3, 4], [s * stride + 16 for s in [3, 5, 4, 1, 0, 7]])
    assert torch.equal(cache.tensor[:6].view(torch.int16), before[:6].view(torch.int16))


# -- end to end ------------------------------------------------------------------------------


def bf16_llm(model_dir: str, offload: dict | None = None) -> LLM:
    kw: dict[str, Any] = dict(num_gpu_blocks=24, dtype="bfloat16", device="cpu")
    if offload is not None:
        kw.update(kv_offload=True, kv_offload_config=offload)
    return LLM(model_dir, **kw)


def tiers(tmp_path: Path, compression: str) -> dict:
    return {
        "decision": "load",
        "compression": compression,
        "tiers": [
            {"kind": "host", "capacity": f"{12 * 3400}B"},  # ~12 slots of a compressed block
            {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"},
        ],
    }


def test_compressed_blocks_keep_outputs_across_tiers_and_a_restart(
    model_dir: str, tmp_path: Path
) -> None:
    reference = run_conversations(bf16_llm(model_dir))
    config = tiers(tmp_path, "lossless")
    with bf16_llm(model_dir, config) as llm:
        assert run_conversations(llm) == reference
        kv = llm.kv_stats()
        codec = llm.engine.offload.worker._saver.codec  # type: ignore[union-attr]
    assert codec is not None
    assert kv["tiers"]["host"]["hit_blocks"] > 0 and kv["tiers"]["lmdb"]["hit_blocks"] > 0
    assert kv["failed_loads"] == 0 and kv["recomputed_tokens"] == 0
    assert kv["save_incompressible_blocks"] == 0
    assert kv["saved_bytes"] == kv["saved_blocks"] * codec.payload_bytes
    # A restarted engine finds them in LMDB; one storing raw blocks does not see them.
    with bf16_llm(model_dir, config) as again:
        assert run_conversations(again, turns=1) == reference[:6]
        assert again.kv_stats()["tiers"]["lmdb"]["hit_blocks"] == 6 * 2
    with bf16_llm(model_dir, tiers(tmp_path, "none")) as raw:
        assert run_conversations(raw, turns=1) == reference[:6]
        assert raw.kv_stats()["tiers"]["lmdb"].get("hit_blocks", 0) == 0


def test_worker_drops_incompressible_blocks_and_decodes_read_through_loads(tmp_path: Path) -> None:
    from cachestore.codec import encoded_size
    from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
    from connectors.offload.metadata import BlockLoad, BlockSave, KVConnectorMetadata
    from connectors.offload.stats import OffloadStats
    from connectors.offload.worker import OffloadWorker, block_meta
    from tiers import build_tiers
    from tiers.config import parse_tier_config

    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    cache = KVCache(spec, 6, "cpu")
    codec = Hi4Codec.for_cache(cache)
    meta = block_meta(cache, "ns", codec)
    assert meta.payload_bytes == codec.payload_bytes and meta.layout.endswith("+hi4")
    blocks = kv_like(2, codec, seed=5)
    spread = torch.logspace(-30, 30, codec.segment_values).bfloat16().view(torch.uint8)
    blocks[1, : 2 * codec.segment_values] = spread  # segment 0: far too many escapes
    cache.tensor[:2].view(2, -1).view(torch.uint8).copy_(blocks)

    def stack(tiers: list[dict]) -> HierarchicalStore:
        slot = pad16(encoded_size(meta, keyed=True))
        return HierarchicalStore(
            build_tiers(parse_tier_config({"tiers": tiers}), host_slot_bytes=slot),
            StoreConfig(namespace="ns"),
        )

    lmdb = {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "8MiB"}
    store = stack([{"kind": "host", "capacity": f"{4 * encoded_size(meta, keyed=True)}B"}, lmdb])
    stats = OffloadStats()
    worker = OffloadWorker(cache, store, meta, load_timeout_s=5.0, stats=stats, codec=codec)
    worker.save_now((BlockSave(0, "ns/00"), BlockSave(1, "ns/01")))
    assert stats.save_incompressible_blocks == 1 and stats.saved_blocks == 1
    assert len(store.lookup(["ns/00"]).served_by) == 1
    assert len(store.lookup(["ns/01"]).served_by) == 0
    store.tiers[1].put_many([("ns/00", bytes(store.tiers[0].get_many(["ns/00"])[0]))])  # demoted
    worker.close()
    store.close()
    # LMDB alone (no host slab): the load reads through the store and decodes the payloads.
    store = stack([lmdb])
    worker = OffloadWorker(
        cache, store, meta, load_timeout_s=5.0, stats=OffloadStats(), codec=codec
    )
    try:
        cache.tensor.zero_()
        worker.start_load_kv(
            KVConnectorMetadata(
                loads=(BlockLoad("r", (4,), ("ns/00",), 0, ("lmdb",)),), num_scheduled_requests=0
            )
        )
        [result] = worker.take_report().finished_loads
        assert result.num_loaded_blocks == 1
        assert torch.equal(cache.tensor[4].reshape(-1).view(torch.uint8), blocks[0])
    finally:
        worker.close()
        store.close()


def segment_bases(codec: Hi4Codec, offsets: list[int], first: int) -> DecodeBases:
    """Bases of whole payloads at ``offsets`` for decoding from segment ``first`` on: the
    codes and low bytes of that segment (what a layer-wise load's staging holds)."""
    whole = codec.payload_bases(offsets)
    m = codec.segment_values
    return DecodeBases(
        whole.meta, [c + first * m // 2 for c in whole.codes], [lo + first * m for lo in whole.low]
    )


def test_segment_bases_decode_the_segments_they_name() -> None:
    """The pattern the CUDA warm test decodes, through torch: a column slice of a wider index
    and segments from the sixth on rewrite the same bytes."""
    codec = Hi4Codec(8, 512)
    rows = kv_like(3, codec, seed=5)
    enc = codec.encode(rows).reshape(-1)
    offsets = [i * codec.payload_bytes for i in range(3)]
    cache = torch.zeros(3, codec.raw_bytes, dtype=torch.uint8)
    codec.decode_into(enc, offsets, cache, [0, 1, 2])
    cache[:, 5 * 2 * 512 :] = 0  # segments 5.. gone, then decoded again on their own
    wide = codec.decode_index(segment_bases(codec, [0, *offsets], 5), [0, 0, 1, 2], "cpu")
    codec.decode_indexed(enc, wide[:, 1:], cache, 5, 3)
    assert torch.equal(cache, rows)


def test_warm_compiles_nothing_off_cuda() -> None:
    """On the CPU blocks decode through torch: nothing to compile, nothing run."""
    assert Hi4Codec(4, 512).warm("cpu") is False


@pytest.mark.gpu
def test_cuda_warm_compiles_the_decoder_so_a_first_decode_is_fast() -> None:
    """``warm`` runs both kernels (whole payloads, one segment) on a zero block; the first
    decode of real blocks after it takes no compilation (an H200 QA run's first reload of
    compressed blocks took 322 ms against ~11 for the next ones)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import time

    codec = Hi4Codec(64, 16384)
    assert codec.warm("cuda") is True
    rows = kv_like(4, codec, seed=3).cuda()
    enc = codec.encode(rows).reshape(-1)
    cache = torch.zeros(4, codec.raw_bytes, dtype=torch.uint8, device="cuda")
    offsets = [i * codec.payload_bytes for i in range(4)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    codec.decode_into(enc, offsets, cache, [0, 1, 2, 3])
    # a layer-wise load's pattern: a column slice of a wider index (odd stride, 8-byte
    # aligned start) and a group's first segment other than 0
    wide = codec.decode_index(segment_bases(codec, [0, *offsets], 5), [0, 0, 1, 2, 3], "cuda")
    codec.decode_indexed(enc, wide[:, 1:], cache, 5, 3)
    torch.cuda.synchronize()
    assert time.perf_counter() - t0 < 0.05  # no compilation (~0.3 s a pattern) after warm
    assert torch.equal(cache, rows)


@pytest.mark.gpu
def test_cuda_encode_and_decode_a_llama_sized_block_exactly() -> None:
    """The Llama-3-8B block (64 segments of 16384 values): encoded on the GPU, decoded by
    the Triton kernels from a staging offset into scattered cache rows, byte for byte."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    codec = Hi4Codec(64, 16384)
    rows = kv_like(4, codec, seed=7).cuda()
    enc = codec.encode(rows)
    assert codec.payload_bytes / codec.raw_bytes < 0.77
    assert not any(codec.overflowed(memoryview(e.numpy())) for e in enc.cpu())
    src = torch.cat([torch.zeros(64, dtype=torch.uint8, device="cuda"), enc.reshape(-1)])
    cache = torch.zeros(6, codec.raw_bytes, dtype=torch.uint8, device="cuda")
    codec.decode_into(src, [64 + i * codec.payload_bytes for i in range(4)], cache, [5, 0, 2, 3])
    assert torch.equal(cache[[5, 0, 2, 3]], rows)
    assert cache[[1, 4]].eq(0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["async", "in_step", "in_step_layered"])
def test_cuda_compressed_offload_keeps_outputs(model_dir: str, mode: str) -> None:
    """On CUDA (side-stream encode on save, staged copies and Triton decode on load; in-step
    loads layer by layer through driver 2-D copies by default, whole with ``layered_loads:
    false``): the same tokens as the engine without offload, blocks loaded from the host
    tier."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kw: dict[str, Any] = dict(
        num_gpu_blocks=24, dtype="bfloat16", device="cuda", attention_backend="torch"
    )
    reference = run_conversations(LLM(model_dir, **kw))
    config = {
        "decision": "load",
        "compression": "lossless",
        "in_step_host_loads": mode != "async",
        **({} if mode == "in_step_layered" else {"layered_loads": False}),
        "tiers": [{"kind": "host", "capacity": "64MiB"}],
    }
    with LLM(model_dir, kv_offload=True, kv_offload_config=config, **kw) as llm:
        layered = llm.engine.offload.worker.layered_loads  # type: ignore[union-attr]
        assert layered == (mode == "in_step_layered")
        assert run_conversations(llm) == reference
        kv = llm.kv_stats()
    assert kv["tiers"]["host"]["hit_blocks"] > 0 and kv["failed_loads"] == 0
    assert kv["recomputed_tokens"] == 0 and kv["save_incompressible_blocks"] == 0


def test_staging_plan_covers_every_payload_once_within_the_buffer() -> None:
    from connectors.device.decode import staging_plan

    n, stride, cap = 100, 112, 1000
    slots = [9, 8, 7, 6, 5, 4, 3, 20, 0, 1, 2, 30, 31, 32, 33, 34, 35, 36, 37, 38, 12]
    offsets = [s * stride + 16 for s in slots]
    host = torch.randint(
        0, 255, (40 * stride,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    seen: list[int] = []
    chunks = staging_plan(offsets, n, cap)
    assert len(chunks) > 2
    for copies, entries in chunks:
        staging = torch.zeros(cap, dtype=torch.uint8)
        for dst, src, span in copies:
            assert dst % 16 == 0 and dst + span <= cap
            staging[dst : dst + span] = host[src : src + span]
        for at, j in entries:
            assert torch.equal(staging[at : at + n], host[offsets[j] : offsets[j] + n])
            seen.append(j)
    assert sorted(seen) == list(range(len(offsets)))
    assert sum(len(c) for c, _ in chunks) < len(offsets)  # runs moved as one copy


def llama_slab(
    device: str, seed: int
) -> tuple[KVCache, Hi4Codec, torch.Tensor, torch.Tensor, list[int], list[int]]:
    """48 Llama-3-8B-shaped cache blocks on ``device``, 40 KV-like blocks encoded in a slab
    (pinned on CUDA) in a descending run of slots and scattered ones, and 40 scattered block
    ids: (cache, codec, the blocks' bytes, slab, payload offsets, ids)."""
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    cache = KVCache(spec, 48, device)
    codec = Hi4Codec.for_cache(cache)
    rows = kv_like(40, codec, seed=seed)
    enc = codec.encode(rows)
    stride = pad16(codec.payload_bytes + 160)
    host = torch.zeros(48 * stride, dtype=torch.uint8)
    host = host.pin_memory() if device == "cuda" else host
    slots = list(range(30, 5, -1)) + [40, 2, 44, 0, 1, 3, 4, 41, 42, 43, 45, 46, 47, 5, 31]
    assert len(set(slots)) == 40
    offsets = [s * stride + 160 for s in slots]
    for i, o in enumerate(offsets):
        host[o : o + codec.payload_bytes] = enc[i]
    ids = torch.randperm(48, generator=torch.Generator().manual_seed(seed))[:40].tolist()
    return cache, codec, rows, host, offsets, ids


@pytest.mark.gpu
def test_cuda_slab_copier_decodes_across_staging_chunks() -> None:
    """40 Llama-sized blocks (~61 MiB encoded: several chunks in both staging buffers), a
    descending run and scattered slots, into scattered cache blocks: byte for byte."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cache, codec, rows, host, offsets, ids = llama_slab("cuda", 11)
    copier = SlabCopier(cache, host, codec=codec)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        copier.to_device(ids, offsets)
    torch.cuda.synchronize()
    got = cache.tensor.reshape(48, -1).view(torch.uint8)[ids].cpu()
    assert torch.equal(got, rows)


def test_copy2d_moves_strided_rows_and_checks_bounds() -> None:
    from connectors.device.copy2d import copy2d

    src = torch.arange(200, dtype=torch.int32).to(torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    copy2d(dst, 4, 10, src, 3, 50, 6, 3)  # rows at 3, 53, 103 -> 4, 14, 24
    for r in range(3):
        assert dst[4 + 10 * r : 10 + 10 * r].tolist() == list(range(3 + 50 * r, 9 + 50 * r))
    assert dst[:4].eq(0).all() and dst[10:14].eq(0).all()
    with pytest.raises(ValueError, match="past the end of src"):
        copy2d(dst, 0, 10, src, 150, 50, 6, 2)
    with pytest.raises(ValueError, match="past the end of dst"):
        copy2d(dst, 60, 10, src, 0, 50, 6, 1)


@pytest.mark.parametrize("layer_bytes", [1 << 20, 3 * 512 * 3])  # one row group; 1-3 rows
@pytest.mark.parametrize(
    "per_copy, groups",
    [
        (0, [(0, 5)]),  # automatic: all 5 small layers at once
        (1, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
        (2, [(0, 1), (1, 3), (3, 5)]),  # the remainder first
        (-1, [(0, 1), (1, 3), (3, 4), (4, 5)]),  # automatic, rows of 4 layers tapered to 1
    ],
)
def test_layer_wise_decode_lands_every_layer(
    monkeypatch: pytest.MonkeyPatch, layer_bytes: int, per_copy: int, groups: list[tuple[int, int]]
) -> None:
    """``to_device_layers``' staging (metadata first, then each group of layers' codes and low
    bytes by 2-D copies per run, two layer buffers in turn, rows per buffer by group width)
    run on the CPU: every block comes back, whatever the groups."""
    import connectors.device.decode as od

    monkeypatch.setattr(od, "LAYER_BYTES", layer_bytes)
    if per_copy < 0:  # what Llama-sized segments get: 8 layers a copy, the last 8 as 4, 2, 2
        monkeypatch.setattr(od, "MIN_ROW_BYTES", 4 * 512)
        monkeypatch.setattr(od, "MIN_TAIL_ROW_BYTES", 512)
    spec = KVCacheSpec(num_layers=5, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    cache = KVCache(spec, 10, "cpu")
    codec = Hi4Codec.for_cache(cache)
    blocks = kv_like(8, codec, seed=9)
    stride = codec.payload_bytes + 32
    host = torch.zeros(12 * stride, dtype=torch.uint8)
    slots = [7, 6, 5, 4, 0, 9, 10, 2]  # a descending run, one alone, an ascending pair, one
    enc = codec.encode(blocks)
    for i, slot in enumerate(slots):
        host[slot * stride + 16 : slot * stride + 16 + codec.payload_bytes] = enc[i]
    rows = cache.tensor.reshape(10, -1).view(torch.uint8)
    decoder = od.StagedDecoder(
        codec, rows, host, spec.num_layers, force_layers=True, layers_per_copy=max(per_copy, 0)
    )
    assert decoder.layer_groups() == groups
    ids = [3, 9, 0, 5, 1, 8, 2, 6]
    assert decoder.to_device_layers(ids, [s * stride + 16 for s in slots]) == []
    for i, b in enumerate(ids):
        assert torch.equal(rows[b], blocks[i])
    assert rows[[4, 7]].eq(0).all()


def test_layer_wise_decode_refuses_what_would_leave_its_bounds() -> None:
    """Segments whose parts would not stay 16-byte aligned get no layer-wise path; a block id
    outside the cache is an error before anything is copied."""
    import connectors.device.decode as od

    host = torch.zeros(1 << 16, dtype=torch.uint8)
    odd = Hi4Codec(4, 24)
    rows = torch.zeros((4, odd.raw_bytes), dtype=torch.uint8)
    assert not od.StagedDecoder(odd, rows, host, 2, force_layers=True).layered
    codec = Hi4Codec(4, 512)
    rows = torch.zeros((4, codec.raw_bytes), dtype=torch.uint8)
    decoder = od.StagedDecoder(codec, rows, host, 2, force_layers=True)
    with pytest.raises(ValueError, match="block id out of range"):
        decoder.to_device_layers([1, 4], [0, codec.payload_bytes])
    assert rows.eq(0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("per_copy, stages", [(1, 32), (0, 6), (5, 7)])
def test_cuda_layer_wise_decode_across_groups(
    monkeypatch: pytest.MonkeyPatch, per_copy: int, stages: int
) -> None:
    """On CUDA (driver 2-D copies, decode stream, one event per group of layers), Llama-sized
    blocks in several row groups (1 MiB layer buffers: 21 rows a buffer for 1 layer a copy,
    2, 5 and 10 for the automatic groups of 8, 4 and 2, 4 for 5): byte for byte, and every
    layer event completes."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import connectors.device.decode as od

    monkeypatch.setattr(od, "LAYER_BYTES", 1 << 20)
    cache, codec, rows, host, offsets, ids = llama_slab("cuda", 13)
    copier = SlabCopier(cache, host, codec=codec, layered=True, layers_per_copy=per_copy)
    assert copier.layered and copier.load_stages == stages
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        events = copier.to_device_layers(ids, offsets)
    assert len(events) == 32 and len({id(e) for e in events}) == stages
    events[-1].synchronize()
    assert all(e.query() for e in events)
    got = cache.tensor.reshape(48, -1).view(torch.uint8)[ids].cpu()
    assert torch.equal(got, rows)
