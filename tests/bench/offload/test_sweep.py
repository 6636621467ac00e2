"""bench/offload/main.py's cost-model sweep on CPU: its loads go through the engine's lower-tier load
path (cold, exact bytes, the throttle's floor), its calibration sizes, and the section's figures
on a tiny random Llama (real LMDB in tmp dirs, no mocks)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.offload.parts import Setup
from bench.offload.sweep import SweepLoads, bench_sweep, calibration_sizes
from cachestore.codec import decode_block, encoded_size
from connectors.offload.worker import block_meta
from engine.kv_cache import KVCache, KVCacheSpec


@pytest.fixture()
def loads(tmp_path: Path) -> Iterator[SweepLoads]:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    out = SweepLoads(KVCache(spec, 8, torch.device("cpu")), str(tmp_path / "lmdb"), 8)
    yield out
    out.close()


def test_calibration_sizes_are_an_eighth_a_half_and_all() -> None:
    assert calibration_sizes(256) == (32, 128, 256)
    assert calibration_sizes(16) == (2, 8, 16)
    assert calibration_sizes(4) == (1, 2, 4)
    assert calibration_sizes(1) == (1,)


def test_sweep_load_lands_the_lmdb_bytes_in_the_cache(loads: SweepLoads) -> None:
    loads.load(2, 7)
    for row, key in enumerate(loads.keys[2:7]):
        payload = decode_block(loads.lmdb.get_many([key])[0], None).payload
        got = loads.kv.tensor[row].reshape(-1).view(torch.uint8).numpy().tobytes()
        assert got == bytes(payload)
    assert loads.host.lookup(loads.keys[2:7]) == 5  # staged into the host slab on the way


def test_every_sweep_load_is_cold_and_pays_the_throttle(loads: SweepLoads) -> None:
    slot = encoded_size(block_meta(loads.kv, "bench-sweep"), keyed=True)
    loads.throttle(0.03, 4 * slot / 0.02)  # 4 blocks: at least 30 + 20 ms
    first = loads.load(0, 4)
    again = loads.load(0, 4)  # the host tier holds them now: dropped first, LMDB serves again
    assert first >= 0.05 and again >= 0.05
    loads.throttle(0.0, float("inf"))
    assert loads.load(0, 4) < 0.05  # the same cold path, unthrottled: 4 x 8 KiB
    assert loads.timer()(3) > 0


def test_bench_sweep_on_a_tiny_llama(tmp_path: Path) -> None:
    from tests.engine.hf_models import make_tiny_model

    model = make_tiny_model(tmp_path / "models", "llama", seed=7)
    setup = Setup(
        model,
        torch.device("cpu"),
        str(tmp_path),
        (256,),
        16,
        {},
        ((0.25, 0.0), (16.0, 0.5)),
        2048,
        60.0,
        dtype="float32",
        sweep_lengths=(256,),
    )
    res = bench_sweep(setup)
    points = res["points"]
    assert res["num_points"] == len(points) == 2
    slow, fast = points
    assert fast["nominal_gbps"] / slow["nominal_gbps"] == pytest.approx(64.0)
    assert slow["nominal_latency_s"] == 0.0
    assert fast["nominal_latency_s"] == pytest.approx(0.5 * fast["recompute_s"])
    # The tiny Llama: 2 layers, 2 KV heads of 16, float32: 8 KiB per block.
    slot = encoded_size(
        block_meta(
            KVCache(KVCacheSpec(2, 2, 16, torch.float32), 1, torch.device("cpu")), "bench-sweep"
        ),
        keyed=True,
    )
    for p in points:
        assert p["prefix_tokens"] == 256
        assert [n for n, _ in p["calibration"]] == [2, 8, 16]
        # A cold read of 16 blocks can not beat the throttle's floor.
        floor = p["nominal_latency_s"] + 16 * slot / (p["nominal_gbps"] * 1e9)
        assert p["read_all_s"] >= floor
        assert p["load_all_s"] > p["read_all_s"]
        best = min(p["recompute_s"], p["load_all_s"], p["chosen_s"])
        assert p["ratio_to_best"] == pytest.approx(p["chosen_s"] / best)
        if p["choice"] == "recompute":
            assert p["chosen_s"] == p["recompute_s"] and p["load_blocks"] == [0, 0]
        assert p["choice"] in ("recompute", "load_prefix", "overlap")
    assert res["within_5pct"] == sum(p["ratio_to_best"] <= 1.05 for p in points)
    assert res["num_not_slower_than_both"] == sum(p["not_slower_than_both"] for p in points)
    assert res["worst_read_prediction_error"] == max(
        abs(p["predicted_read_all_s"] / p["read_all_s"] - 1) for p in points
    )
    assert res["path_ceiling"]["block_bytes"] == 8192  # 2 layers x (K, V) x 16 x 2 x 16 x 4 B
