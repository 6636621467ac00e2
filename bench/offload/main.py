"""KV offload benchmark: block transfers, TTFT with reload vs recompute, multi-round QA, and the
cost model's choice against the measured best, each beside its baseline in the same run.

    python -m bench.offload --out DIR            # CUDA: Llama-3-8B shape, random bf16 weights
    python -m bench.offload --out DIR --quick    # CPU (or CUDA): the embedded demo model
    python -m bench.offload --out DIR --tiny     # the full code path (random-weight loader,
                                                 # bf16 on CUDA) with a tiny Llama config

Runtime on one H200 is bounded by ``--lengths``, ``--lmdb-max-len`` (the LMDB TTFT mode only
for prefixes up to this length: a 16K prefix is 2 GiB of LMDB writes per repetition),
``--reps``, ``--sweep-lengths``, ``--qa-users`` and ``--qa-concurrency``; the defaults aim at
about 4 minutes.

Sections (JSON keys):
- ``transfer``: ``KVCache.gather_blocks`` + one (pinned) host copy, and ``scatter_blocks`` back,
  of 256 random blocks of the Llama-3-8B shape (2 MiB each), vs a raw ``copy_`` of the bytes.
- ``load_path``: N host-tier blocks (2 MiB each) loaded into the cache through the worker's
  real load path (host fast path), one copy per block and ``coalesced_loads`` (one copy per
  run of consecutive slots, here one run), vs a raw ``copy_`` of the same bytes and vs the
  decode path.
- ``ttft``: a prefix of 1K/4K/16K tokens is prefilled, written to the tiers (``flush_kv``) and
  dropped from the GPU prefix cache; then the same prefix with a new question: recompute
  (offload off), reload from host, reload from LMDB (a 4-slot host tier demotes everything to
  LMDB): pipelined (``lmdb``), serial (``lmdb_serial``: read all, then copy), the forced Cake
  split (``lmdb_overlap``) and ``decision: cost`` over it (``lmdb_cost``), compared per length
  in ``ttft.lmdb``; and ``decision: cost`` over the host tier (the engine's own cost model).
- ``pipeline`` (bench/offload/pipeline.py): an LMDB -> cache load alone, its read and copy
  parts, serial and pipelined over a grid of chunk sizes and depths (interleaved medians).
- ``reload_steps``: the fixed cost of a reload. For each prefix length, one engine per mode of
  ``--reload-modes`` (``RELOAD_MODES``): recompute (offload off), host reload with
  ``in_step_host_loads: false`` (the load waits in WAITING_FOR_KV and the request runs one
  step later), in-step loads (copied before the forward of the admitting step) and the CUDA
  variants (layer-wise loads, coalesced copies, Triton small-query attention for the new
  tokens). Reports engine steps from ``add_request`` to the first token, TTFT, each step's
  wall time and the time in the scheduler, the worker's pre-forward hook and the runner;
  recompute over each mode.
- ``qa``: LMCache-style multi-round QA, offload off vs on (``decision: cost``, a host tier that
  keeps every history), the same event-driven driver for both (``run_qa``): ``users`` users
  (shared system prompt + a long own context) each ask ``rounds`` questions one after another
  (the next goes out when the previous answer is back), at most ``concurrency`` requests in
  flight, admitted in a fixed round-robin order (user 0..U-1 of round r, then round r + 1),
  greedy answers of ``answer`` tokens. The GPU pool holds ``concurrency + 1`` longest
  histories: requests in flight never wait for blocks, but a user's history is evicted before
  its next round. So TTFT measures what offload changes (reload of an evicted history vs its
  recompute), not queueing behind a barrier of simultaneous requests. Reports TTFT p50/p99 (all
  requests; rounds >= 1 alone), output tokens/s over the wall time, per-request cached and
  loaded tokens (from the engine's request log) and the decisions.
- ``sweep``: prefix length x tier speed. A real LMDB tier behind a throttle (latency plus a
  bandwidth cap) under a host tier, read through the engine's lower-tier load path (the
  connector's ``OffloadWorker``: staging into the host slab, then slab -> cache copies), cold
  (the blocks dropped from the host tier first). The model is calibrated through that same
  path at the prefix's own batch sizes (``calibrate_transfer``), so the tier's effective
  bandwidth (reported beside the throttle's nominal one) includes its per-block costs; each
  point times recompute, load-all (load + prefill of the rest) and the model's choice from
  measured parts (an ``overlap`` choice combines its measured parts with max(), as it would
  run).

``--interleave`` (ttft): every mode's engine is built first and each repetition runs the modes
in turn, rotating the order, so drift (page cache, clocks, neighbours) weighs on each alike;
each timed reload first waits for its prefix's writes to the tiers to finish.

Every TTFT point (``ttft``, ``reload_steps``) runs ``--warmup-reps`` unmeasured repetitions first
(1 on the full run): a length's first reload meets kernels the 64-token warm-up did not.

The 8B shape is built directly on the device with random weights: ``engine.runner.model_runner``'s
``load_model`` is wrapped (in this process only) for directories this script marks, so no 16 GB
checkpoint is ever written. Prints one JSON document and a one-line summary; ``--out DIR`` also
writes DIR/offload.json. A section that fails is reported as ``{"error": ...}``; the rest run.
Set-up and engine helpers live in bench/offload/parts.py, the QA section in
bench/offload/qa.py, the sweep in bench/offload/sweep.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.common import machine_info  # noqa: E402
from bench.offload.parts import (  # noqa: E402
    GREEDY1,
    Setup,
    _ttft_once,
    best_time,
    build_setup,
    bytes_per_block,
    close_llm,
    first_token_steps,
    make_llm,
    random_tokens,
    run_requests,
    two_byte_kv,
)
from bench.offload.pipeline import bench_pipeline  # noqa: E402
from bench.offload.qa import bench_qa  # noqa: E402
from bench.offload.sweep import bench_sweep  # noqa: E402
from engine.kv_cache import KVCache, KVCacheSpec  # noqa: E402

# -- transfer -------------------------------------------------------------------------------


def bench_transfer(setup: Setup, repeats: int = 5) -> dict[str, Any]:
    """Block gather/scatter through KVCache vs a raw copy of the same bytes, best of repeats."""
    dev, n = setup.device, setup.transfer_blocks
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    kv = KVCache(spec, 2 * n, dev)
    ids = torch.randperm(2 * n, generator=torch.Generator().manual_seed(0))[:n].tolist()
    pinned = dev.type == "cuda"
    host = torch.empty((n, *spec.block_shape), dtype=spec.dtype, pin_memory=pinned)
    raw_dev = torch.empty_like(host, device=dev)
    nbytes = n * spec.bytes_per_block

    def best(fn: Callable[[], object]) -> float:
        return best_time(fn, dev, repeats)

    rows = {}
    cases = {
        "device_to_host": (
            lambda: host.copy_(kv.gather_blocks(ids), non_blocking=pinned),
            lambda: host.copy_(raw_dev, non_blocking=pinned),
        ),
        "host_to_device": (
            lambda: kv.scatter_blocks(ids, host),
            lambda: raw_dev.copy_(host, non_blocking=pinned),
        ),
    }
    for name, (blocks_fn, raw_fn) in cases.items():
        t_blocks, t_raw = best(blocks_fn), best(raw_fn)
        rows[name] = {
            "blocks_gbps": nbytes / t_blocks / 1e9,
            "raw_gbps": nbytes / t_raw / 1e9,
            "ratio": t_raw / t_blocks,
        }
    return {"num_blocks": n, "block_bytes": spec.bytes_per_block, "pinned": pinned, **rows}


def bench_copy2d(setup: Setup, repeats: int = 5) -> dict[str, Any]:
    """Host -> device 2-D copies (``connectors.device.copy2d``: the layer-wise loads' DMA) at several
    row widths, rows a compressed Llama-3-8B payload apart, against one plain copy of as many
    bytes in the same run. CUDA only (elsewhere it is a strided torch copy)."""
    from connectors.device.copy2d import copy2d, copy2d_available
    from connectors.device.kv_compress import Hi4Codec

    if setup.device.type != "cuda" or not copy2d_available():
        return {"skipped": "needs CUDA and the driver's 2-D copies"}
    rows = max(setup.transfer_blocks, 256)
    pitch = Hi4Codec(64, 16384).payload_bytes
    host = torch.empty(rows * pitch, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(rows * pitch, dtype=torch.uint8, device=setup.device)
    out: dict[str, Any] = {"rows": rows, "src_pitch": pitch, "widths": {}}
    for width in (16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10):
        nbytes = rows * width
        t2d = best_time(
            lambda w=width: copy2d(dev, 0, w, host, 0, pitch, w, rows), setup.device, repeats
        )
        t1d = best_time(
            lambda n=nbytes: dev[:n].copy_(host[:n], non_blocking=True), setup.device, repeats
        )
        out["widths"][str(width)] = {
            "copy2d_gbps": nbytes / t2d / 1e9,
            "plain_gbps": nbytes / t1d / 1e9,
            "ratio": t1d / t2d,
        }
    return out


def bench_load_path(setup: Setup, repeats: int = 5) -> dict[str, Any]:
    """The worker's real load path for N blocks of the Llama-3-8B shape held by the host tier
    (``prepare_load`` -> ``start_load_kv`` -> ``take_report``: locate in the slab, one copy per
    block) vs a raw ``copy_`` of the same bytes, and vs the decode path (``store.get_many``:
    checksum + copy into a staging tensor + one scatter: what loads did before the fast path).
    Best of ``repeats``; the cache's device is the setup's (CPU for --quick/--tiny)."""
    from cachestore.codec import encode_block, encoded_size
    from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
    from cachestore.store.loads import HostCheck
    from connectors.device.kv_compress import Hi4Codec
    from connectors.device.slab_runs import pad16
    from connectors.offload.metadata import BlockLoad, KVConnectorMetadata
    from connectors.offload.stats import OffloadStats
    from connectors.offload.worker import OffloadWorker, block_meta
    from tiers.host import HostTier

    dev, n = setup.device, max(setup.transfer_blocks, 64)
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    kv = KVCache(spec, 2 * n, dev)
    ids = tuple(torch.randperm(2 * n, generator=torch.Generator().manual_seed(1))[:n].tolist())
    meta = block_meta(kv, "bench-load-path")
    slot = encoded_size(meta, keyed=True)  # blocks carry their key, as the engine's do
    store = HierarchicalStore(
        [HostTier(n * slot, slot)], StoreConfig(namespace=meta.namespace, promote_on_get=False)
    )
    workers: dict[object, OffloadWorker] = {
        c: OffloadWorker(
            kv, store, meta, load_timeout_s=120.0, stats=OffloadStats(), coalesced_loads=c
        )
        for c in (False, True)
    }
    gen = torch.Generator().manual_seed(2)
    host = torch.randint(
        -(2**15), 2**15 - 1, (n, spec.bytes_per_block // 2), generator=gen, dtype=torch.int16
    ).view(torch.uint8)
    host = host.pin_memory() if dev.type == "cuda" else host
    keys = tuple(f"{meta.namespace}/{i:064x}" for i in range(n))
    store.put_many(
        [(k, encode_block(memoryview(host[i].numpy()), meta, key=k)) for i, k in enumerate(keys)]
    )
    raw_dev = torch.empty((n, spec.bytes_per_block), dtype=torch.uint8, device=dev)
    nbytes = n * spec.bytes_per_block

    def load(coalesced: bool = False) -> None:
        worker = workers[coalesced]
        spec = store.prepare_load(keys, HostCheck.for_meta(meta))
        worker.start_load_kv(
            KVConnectorMetadata(
                loads=(BlockLoad("bench", ids, keys, 0, ("host",) * n, spec=spec),),
                num_scheduled_requests=0,
            )
        )
        [done] = worker.take_report().finished_loads
        assert done.num_loaded_blocks == n, done

    def loaded_bytes_ok() -> bool:
        got = kv.tensor[list(ids)].reshape(n, -1).view(torch.uint8).cpu()
        return bool(torch.equal(got, host.cpu()))

    def decode_path() -> None:
        staging = torch.empty(
            (n, *spec.block_shape), dtype=spec.dtype, pin_memory=dev.type == "cuda"
        )
        rows = staging.view(torch.uint8).view(n, -1).numpy()
        for i, value in enumerate(store.get_many(keys)):
            rows[i] = memoryview(value).cast("B")  # type: ignore[arg-type]
        kv.scatter_blocks(list(ids), staging)

    def best(fn: Callable[[], object]) -> float:
        return best_time(fn, dev, repeats)

    # ``compression: lossless``: the same blocks, KV-like values (Gaussian bf16; random bytes
    # do not compress), stored encoded in a store of their own; the load decodes them.
    codec = Hi4Codec.for_cache(kv)
    lmeta = block_meta(kv, "bench-load-path-lossless", codec)
    lslot = pad16(encoded_size(lmeta, keyed=True))
    lstore = HierarchicalStore(
        [HostTier(n * lslot, lslot)], StoreConfig(namespace=lmeta.namespace, promote_on_get=False)
    )
    lkeys = tuple(f"{lmeta.namespace}/{i:064x}" for i in range(n))
    kvlike = (torch.randn(n, spec.bytes_per_block // 2, generator=gen) * 1.3).bfloat16()
    kvlike = kvlike.view(torch.uint8).view(n, -1)
    lstore.put_many(
        [
            (k, encode_block(memoryview(codec.encode(kvlike[i : i + 1])[0].numpy()), lmeta, key=k))
            for i, k in enumerate(lkeys)
        ]
    )
    lworker = OffloadWorker(
        kv, lstore, lmeta, load_timeout_s=120.0, stats=OffloadStats(), codec=codec
    )
    workers["lossless"] = lworker

    def load_lossless() -> None:
        spec = lstore.prepare_load(lkeys, HostCheck.for_meta(lmeta))
        lworker.start_load_kv(
            KVConnectorMetadata(
                loads=(BlockLoad("bench", ids, lkeys, 0, ("host",) * n, spec=spec),),
                num_scheduled_requests=0,
            )
        )
        [done] = lworker.take_report().finished_loads
        assert done.num_loaded_blocks == n, done

    try:
        t_raw = best(lambda: raw_dev.copy_(host, non_blocking=dev.type == "cuda"))
        t_load = best(load)
        ok = loaded_bytes_ok()
        kv.tensor.zero_()
        t_coalesced = best(lambda: load(True))  # one run: the keys sit in slots 0..n-1
        ok_coalesced = loaded_bytes_ok()
        t_decode = best(decode_path)
        kv.tensor.zero_()
        t_lossless = best(load_lossless)
        got = kv.tensor[list(ids)].reshape(n, -1).view(torch.uint8).cpu()
        ok_lossless = bool(torch.equal(got, kvlike))
    finally:
        for worker in workers.values():
            worker.close()
        store.close()
        lstore.close()
    return {
        "num_blocks": n,
        "block_bytes": spec.bytes_per_block,
        "device": str(dev),
        "pinned": dev.type == "cuda",
        "bytes_correct": ok,
        "coalesced_bytes_correct": ok_coalesced,
        "raw_gbps": nbytes / t_raw / 1e9,
        "load_path_gbps": nbytes / t_load / 1e9,
        "coalesced_load_path_gbps": nbytes / t_coalesced / 1e9,
        "coalesced_ratio_to_raw": t_raw / t_coalesced,
        "coalesced_vs_per_block": t_load / t_coalesced,
        "decode_path_gbps": nbytes / t_decode / 1e9,
        "load_path_ms": t_load * 1e3,
        "raw_ms": t_raw * 1e3,
        "decode_path_ms": t_decode * 1e3,
        "ratio_to_raw": t_raw / t_load,
        "decode_ratio_to_raw": t_raw / t_decode,
        # Effective (raw KV bytes per second): above 1x, compression beats the raw copy.
        "lossless_bytes_correct": ok_lossless,
        "lossless_payload_bytes": codec.payload_bytes,
        "lossless_load_path_gbps": nbytes / t_lossless / 1e9,
        "lossless_ratio_to_raw": t_raw / t_lossless,
    }


# -- TTFT: recompute vs reload ---------------------------------------------------------------


def _offload_config(setup: Setup, mode: str, slot_bytes: int, tag: str) -> dict[str, Any] | None:
    lmdb = {
        "kind": "lmdb",
        "path": os.path.join(setup.workdir, f"lmdb-{tag}"),
        "capacity": "48GiB" if setup.model_dir else "1GiB",
        # a 16K prefix is 1,024+ blocks written through at once: the default queue (1,024)
        # dropped its tail, so the reload measured found only part of it in LMDB
        "write_queue_blocks": 4096,
    }
    host_cap = f"{setup.host_capacity}B"
    if mode == "recompute":
        return None
    if mode.startswith("lmdb"):  # everything demoted to LMDB: a 4-slot host tier above it
        decision = {
            "lmdb": "load",
            "lmdb_1reader": "load",
            "lmdb_serial": "load",
            "lmdb_cost": "cost",
            "lmdb_overlap": "overlap",
        }[mode]
        serial = {"load_chunk_bytes": 0} if mode == "lmdb_serial" else {}
        if mode == "lmdb_1reader":  # the pipelined load with one reader thread (no split)
            serial = {"load_read_threads": 1}
        return {
            "decision": decision,
            **serial,
            "tiers": [{"kind": "host", "capacity": f"{4 * slot_bytes}B"}, lmdb],
        }
    if "_lossless" in mode:  # the same reload of blocks stored compressed (layer-wise loads)
        return {
            "decision": "cost" if mode.startswith("cost") else "load",
            "compression": "lossless",
            **({"layered_loads": False} if mode == "host_lossless_whole" else {}),
            "tiers": [{"kind": "host", "capacity": host_cap}],
        }
    return {
        "decision": "cost" if mode == "cost" else "load",
        **({"layered_loads": True} if mode == "host_layered" else {}),
        **({"layered_loads": False} if mode in ("host_whole", "host_coalesced") else {}),
        **({"coalesced_loads": True} if mode == "host_coalesced" else {}),
        "tiers": [{"kind": "host", "capacity": host_cap}],
    }


WRITES_TIMEOUT_S = 120.0


def _prefix_in_tiers_only(llm: Any, rng: random.Random, length: int, setup: Setup) -> list[int]:
    """A random ``length``-token prefix, prefilled once, written to the tiers (``flush_kv``) and
    dropped from the GPU prefix cache, so the next request can only load or recompute it."""
    prefix = random_tokens(rng, length)
    run_requests(llm, [prefix + random_tokens(rng, 16)], GREEDY1, setup.request_timeout_s)
    llm.engine.flush_kv()
    # The connector's flush waits for the write-through copies for drain_timeout_s (5 s); a
    # 16K prefix is 2 GiB of LMDB writes, which may take longer: the timed reload must not
    # run beside its own prefix's writes (the H200's 16K LMDB reloads spread 265-412 ms).
    store = getattr(llm.engine.kv_connector, "store", None)
    if store is not None and not store.wait_writes(WRITES_TIMEOUT_S):
        raise RuntimeError(f"the prefix's writes to the tiers took over {WRITES_TIMEOUT_S} s")
    if not llm.engine.pool.reset_prefix_cache():
        raise RuntimeError("GPU blocks still in use after generate")
    return prefix


# lmdb: the pipelined lower-tier load (the default; lmdb_1reader: its chunks read by one
# thread, not split over load_read_threads); lmdb_serial: read all, then copy;
# lmdb_cost / lmdb_overlap: ``decision: cost`` / the forced Cake split over the same LMDB stack;
# host_layered: the host reload with in-step loads landing layer by layer (raw blocks; the
# default, ``layered_loads: auto``, is the same on CUDA); host_whole: whole-block in-step copies
# the forward waits for; host_coalesced: those, with runs of consecutive host slots copied whole
# into staging and scattered (``coalesced_loads``, CUDA).
TTFT_MODES = (
    "recompute",
    "host",
    "host_layered",
    "host_whole",
    "host_coalesced",
    "host_lossless",
    "host_lossless_whole",
    "lmdb",
    "lmdb_1reader",
    "lmdb_serial",
    "lmdb_cost",
    "lmdb_overlap",
    "cost",
    "cost_lossless",
)
# diagnostics, run when named
DEFAULT_TTFT_MODES = tuple(
    m for m in TTFT_MODES if m not in ("lmdb_1reader", "host_whole", "host_coalesced")
)


def _modes(modes: tuple[str, ...] | list[str], setup: Setup) -> list[str]:
    """``modes`` without the ``_lossless`` ones where the KV is not 2-byte (the CPU quick run's
    float32 demo model): ``compression: lossless`` refuses other dtypes."""
    return [m for m in modes if two_byte_kv(setup) or "_lossless" not in m]


def bench_ttft(setup: Setup) -> dict[str, Any]:
    """For each mode, one engine; for each length: prefill prefix+q1, flush to the tiers, drop
    the GPU prefix cache, then time prefix+q2 (TTFT, median of ``reps`` prefixes).
    ``setup.interleave``: every mode's engine is built first and each repetition runs the
    modes in turn, the order rotating from one repetition to the next, so a machine that
    drifts (page cache, clocks, a neighbour) weighs on every mode alike; otherwise one mode
    after the other, each engine closed before the next is built."""
    rng = random.Random(1)
    max_len = max(setup.lengths)
    num_blocks = (max_len + setup.ttft_suffix + 64) // 16 + 4  # the prompt, its question, room
    slot = bytes_per_block(setup) + (64 << 10)  # an encoded block: a header over the bytes
    modes = _modes(setup.ttft_modes or DEFAULT_TTFT_MODES, setup)

    def build(mode: str) -> Any:
        log = (
            {"request_log": os.path.join(setup.request_log_dir, f"ttft_{mode}.jsonl")}
            if setup.request_log_dir
            else {}
        )
        llm = make_llm(setup, num_blocks, _offload_config(setup, mode, slot, mode), **log)
        run_requests(llm, [random_tokens(rng, 64)], GREEDY1, setup.request_timeout_s)  # warm-up
        return llm

    def measure(llm: Any, mode: str, length: int, point: dict[str, list[Any]], i: int) -> None:
        prefix = _prefix_in_tiers_only(llm, rng, length, setup)
        question = random_tokens(rng, setup.ttft_suffix)
        t, c = _ttft_once(llm, prefix + question, setup.request_timeout_s)
        if i < setup.warmup_reps:  # this length's first kernels: not measured
            point["warm"].append(t)
        else:
            point["ttfts"].append(t)
            point["cached"].append(c)

    def finish(llm: Any, points: dict[str, dict[str, list[Any]]]) -> dict[str, Any]:
        per_len: dict[str, Any] = {}
        for length, point in points.items():
            ttfts = sorted(point["ttfts"])
            mid = len(ttfts) // 2
            per_len[length] = {
                "ttft_s": ttfts[mid],
                "cached_tokens": sorted(point["cached"])[mid],
                "all_ttft_s": ttfts,
                "warmup_ttft_s": point["warm"],
            }
        stats = llm.kv_stats()
        per_len["decisions"] = stats.get("decisions", {})
        cost = stats.get("cost_model")
        if cost and sum(per_len["decisions"].values()):
            # what the decisions were made on (prefill curve, tier rates, outcome ratios),
            # kept without a request log (an H100 run's ``decision: cost`` loaded everything
            # six times out of six at 16K, and nothing said why)
            per_len["cost_model"] = {
                k: cost.get(k)
                for k in ("prefill", "tiers", "outcome_ratios", "explored_splits", "decisions")
            }
        per_len["tier_hit_blocks"] = {
            k: v.get("hit_blocks", 0) for k, v in stats.get("tiers", {}).items()
        }
        return per_len

    def lengths_of(mode: str) -> list[int]:
        # a 16K prefix is 2 GiB of LMDB writes per repetition
        return [
            n for n in setup.lengths if not (mode.startswith("lmdb") and n > setup.lmdb_max_len)
        ]

    def empty() -> dict[str, list[Any]]:
        return {"ttfts": [], "cached": [], "warm": []}

    rows: dict[str, dict[str, Any]] = {}
    # Interleaved: one group of every mode, alive at once; otherwise a group per mode.
    for group in [modes] if setup.interleave else [[m] for m in modes]:
        llms: dict[str, Any] = {}
        try:
            for mode in group:
                llms[mode] = build(mode)
            points = {m: {str(n): empty() for n in lengths_of(m)} for m in group}
            for length in setup.lengths:
                for i in range(setup.warmup_reps + setup.reps):
                    turn = i % len(group)
                    for mode in group[turn:] + group[:turn]:
                        if str(length) in points[mode]:
                            measure(llms[mode], mode, length, points[mode][str(length)], i)
            for mode in group:
                rows[mode] = finish(llms[mode], points[mode])
                _log_row("ttft", mode, rows[mode])
        finally:
            for llm in llms.values():
                close_llm(llm)
    speedups = {
        f"{mode}_{length}": rows["recompute"][str(length)]["ttft_s"]
        / rows[mode][str(length)]["ttft_s"]
        for mode in list(rows)[1:]
        for length in setup.lengths
        if str(length) in rows[mode]
    }
    return {
        "modes": rows,
        "interleaved": setup.interleave,
        "speedup_vs_recompute": speedups,
        "lmdb": _lmdb_rows(rows),
    }


def _log_row(section: str, mode: str, row: dict[str, Any]) -> None:
    """One mode's row on stderr as it ends: a run killed at its time limit keeps the modes
    done (the JSON is written only once a section ends)."""
    print(f"[offload] {section} {mode}: {json.dumps(row, default=str)}", file=sys.stderr)


def _lmdb_rows(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per length with every LMDB mode measured: TTFT of recompute, the pipelined and the serial
    reload, the forced overlap and ``decision: cost``, and cost over the best of the others
    (the target: <= 1.05)."""
    names = ("recompute", "lmdb", "lmdb_overlap", "lmdb_cost")  # lmdb_serial: optional
    out: dict[str, dict[str, Any]] = {}
    for length in rows.get("lmdb", {}):
        if not length.isdigit() or any(length not in rows.get(m, {}) for m in names):
            continue
        serial = length in rows.get("lmdb_serial", {})
        measured = (*names, "lmdb_serial") if serial else names
        ms = {m: rows[m][length]["ttft_s"] * 1e3 for m in measured}
        best = min(ms["recompute"], ms["lmdb"], ms["lmdb_overlap"])
        out[length] = {
            "length": int(length),
            **{f"{m}_ms": v for m, v in ms.items()},
            "recompute_over_pipelined": ms["recompute"] / ms["lmdb"],
            "cost_over_best": ms["lmdb_cost"] / best,
        }
        if serial:
            out[length]["pipelined_over_serial"] = ms["lmdb_serial"] / ms["lmdb"]
    return out


# -- reload steps: the fixed cost of a reload ----------------------------------------------


# name -> (offload flags or None for recompute, extra LLM keywords). Every host mode uses
# ``decision: load`` without calibration; ``_sq`` modes run eager few-token steps (the reload's
# forward of the new tokens) through the Triton split-KV kernel instead of FlashInfer's prefill.
RELOAD_MODES: dict[str, tuple[dict[str, Any] | None, dict[str, Any]]] = {
    "recompute": (None, {}),
    "host_async": ({"in_step_host_loads": False}, {}),
    "host_in_step": ({"in_step_host_loads": True}, {}),
    "host_layered": ({"in_step_host_loads": True, "layered_loads": True}, {}),
    "host_coalesced": ({"in_step_host_loads": True, "coalesced_loads": True}, {}),
    "host_sq": ({"in_step_host_loads": True}, {"small_query_attention": "triton"}),
    "host_coalesced_sq": (
        {"in_step_host_loads": True, "coalesced_loads": True},
        {"small_query_attention": "triton"},
    ),
    "host_layered_sq": (
        {"in_step_host_loads": True, "layered_loads": True},
        {"small_query_attention": "triton"},
    ),
    # Compressed: layer-wise in-step loads by default (automatic layers_per_copy), or whole.
    "host_lossless": ({"in_step_host_loads": True, "compression": "lossless"}, {}),
    "host_lossless_whole": (
        {"in_step_host_loads": True, "compression": "lossless", "layered_loads": False},
        {},
    ),
    **{
        f"host_lossless_layers{k}": (
            {
                "in_step_host_loads": True,
                "compression": "lossless",
                "layered_loads": True,
                "layers_per_copy": k,
            },
            {},
        )
        for k in (1, 2, 4, 8, 16)
    },
}
CUDA_ONLY_MODES = {
    "host_layered",
    "host_coalesced",
    "host_sq",
    "host_coalesced_sq",
    "host_layered_sq",
    *(m for m in RELOAD_MODES if m.startswith("host_lossless_layers")),
}
DEFAULT_RELOAD_MODES = ("recompute", "host_async", "host_in_step", "host_layered", "host_lossless")


def bench_reload_steps(setup: Setup) -> dict[str, Any]:
    """Steps to the first token and TTFT for each of ``setup.reload_modes`` (RELOAD_MODES):
    recompute, host reload async (+1 step), in-step, and the CUDA variants (layer-wise,
    coalesced copies, Triton small-query attention). Each mode is its own engine and sees the
    same prompts; median of ``reps`` by TTFT. Ratios are recompute over each mode."""
    names = [
        m
        for m in _modes(setup.reload_modes, setup)
        if setup.device.type == "cuda" or m not in CUDA_ONLY_MODES
    ]
    num_blocks = (max(setup.lengths) + 64) // 16 + 4
    rows: dict[str, dict[str, Any]] = {}
    for mode in names:
        flags, extra = RELOAD_MODES[mode]
        offload = (
            None
            if flags is None
            else {
                "decision": "load",
                "calibrate": False,
                **flags,
                "tiers": [{"kind": "host", "capacity": f"{setup.host_capacity}B"}],
            }
        )
        rng = random.Random(4)
        llm = make_llm(setup, num_blocks, offload, **extra)
        try:
            run_requests(llm, [random_tokens(rng, 64)], GREEDY1, setup.request_timeout_s)
            per_len: dict[str, Any] = {}
            for length in setup.lengths:
                samples, warm = [], []
                for i in range(setup.warmup_reps + setup.reps):
                    prefix = _prefix_in_tiers_only(llm, rng, length, setup)
                    f = first_token_steps(
                        llm, prefix + random_tokens(rng, 16), setup.request_timeout_s
                    )
                    (warm if i < setup.warmup_reps else samples).append(f)
                samples.sort(key=lambda f: f.ttft_s)
                mid = samples[len(samples) // 2]
                per_len[str(length)] = {
                    "ttft_s": mid.ttft_s,
                    "steps_to_first_token": mid.steps,
                    "step_ms": list(mid.step_ms),
                    "schedule_ms": mid.schedule_ms,
                    "load_ms": mid.load_ms,
                    "execute_ms": mid.execute_ms,
                    "cached_tokens": mid.cached_tokens,
                    "all_ttft_s": [f.ttft_s for f in samples],
                    "warmup_ttft_s": [f.ttft_s for f in warm],
                }
            rows[mode] = per_len
            _log_row("reload_steps", mode, per_len)
        finally:
            close_llm(llm)
    ratios: dict[str, dict[str, float]] = {}
    for length in map(str, setup.lengths):
        ttft = {m: rows[m][length]["ttft_s"] for m in rows}
        r = ratios[length] = {}
        if "recompute" in ttft:
            r.update(
                {
                    f"recompute_over_{m.removeprefix('host_')}": ttft["recompute"] / t
                    for m, t in ttft.items()
                    if m != "recompute"
                }
            )
        if "host_async" in ttft and "host_in_step" in ttft:
            r["async_over_in_step"] = ttft["host_async"] / ttft["host_in_step"]
    return {"modes": rows, "ratios": ratios}


# -- main ----------------------------------------------------------------------------------


def _targets(res: dict[str, Any], setup: Setup) -> dict[str, Any]:
    """The issue's H200 targets; meaningful only for the full run on CUDA."""
    t: dict[str, Any] = {}

    def check(name: str, section: str, get: Callable[[dict[str, Any]], float], goal: float) -> None:
        sec = res.get(section, {})
        if "error" in sec or not sec:
            return
        try:
            value = get(sec)
        except KeyError:  # a mode or length this run left out (--ttft-modes, --lengths)
            return
        t[name] = {"value": value, "target": goal, "met": value >= goal}

    check("d2h_ratio", "transfer", lambda s: s["device_to_host"]["ratio"], 0.9)
    check("h2d_ratio", "transfer", lambda s: s["host_to_device"]["ratio"], 0.9)
    check("h2d_gbps", "transfer", lambda s: s["host_to_device"]["blocks_gbps"], 50.0)
    check("load_path_ratio", "load_path", lambda s: s["ratio_to_raw"], 0.9)
    top = str(max(setup.lengths))
    check(
        f"ttft_{top}_host_speedup", "ttft", lambda s: s["speedup_vs_recompute"][f"host_{top}"], 12.0
    )
    check(
        f"ttft_{top}_host_lossless_speedup",
        "ttft",
        lambda s: s["speedup_vs_recompute"][f"host_lossless_{top}"],
        12.0,
    )
    check("qa_ttft_p50_ratio", "qa", lambda s: s["ttft_p50_ratio"], 5.0)
    check("qa_throughput_ratio", "qa", lambda s: s["throughput_ratio"], 2.0)
    check("qa_lossless_ttft_p50_ratio", "qa", lambda s: s["lossless_ttft_p50_ratio"], 5.0)
    check("qa_lossless_throughput_ratio", "qa", lambda s: s["lossless_throughput_ratio"], 2.0)
    check("sweep_within_5pct", "sweep", lambda s: s["within_5pct"] / s["num_points"], 1.0)
    return t


def _summary(res: dict[str, Any], setup: Setup) -> str:
    parts = [
        f"offload ({res['machine'].get('cuda_device') or 'cpu'}, "
        f"{'quick' if setup.model_dir is None else res.get('mode', 'full')}):"
    ]
    tr, tt, qa, sw = (res.get(k, {}) for k in ("transfer", "ttft", "qa", "sweep"))
    lp = res.get("load_path", {})
    rs = res.get("reload_steps", {})
    if "ratios" in rs:
        top = str(max(setup.lengths))
        m, r = rs["modes"], rs["ratios"][top]
        best = min(
            (k for k in m if k != "recompute"), key=lambda k: m[k][top]["ttft_s"], default=None
        )
        if best is not None:
            vs = r.get(f"recompute_over_{best.removeprefix('host_')}")
            parts.append(
                f"reload {top} tok: best {best} TTFT {m[best][top]['ttft_s'] * 1e3:.1f} ms"
                f" in {m[best][top]['steps_to_first_token']} steps"
                + (f" ({vs:.1f}x vs recompute);" if vs else ";")
            )
    c2 = res.get("copy2d", {}).get("widths", {})
    if c2:
        parts.append(
            "copy2d vs plain: "
            + ", ".join(f"{int(w) >> 10}K {v['ratio']:.2f}x" for w, v in c2.items())
            + ";"
        )
    if "ratio_to_raw" in lp:
        parts.append(
            f"host load path {lp['load_path_gbps']:.1f} GB/s "
            f"({lp['ratio_to_raw']:.2f}x raw; coalesced {lp['coalesced_ratio_to_raw']:.2f}x; "
            f"decode path {lp['decode_ratio_to_raw']:.2f}x; lossless "
            f"{lp['lossless_ratio_to_raw']:.2f}x effective);"
        )
    if "device_to_host" in tr:
        parts.append(
            f"blocks d2h {tr['device_to_host']['blocks_gbps']:.1f} GB/s "
            f"({tr['device_to_host']['ratio']:.2f}x raw), h2d "
            f"{tr['host_to_device']['blocks_gbps']:.1f} GB/s "
            f"({tr['host_to_device']['ratio']:.2f}x raw);"
        )
    if "speedup_vs_recompute" in tt:
        top = max(setup.lengths)
        s = tt["speedup_vs_recompute"]
        lm = max(
            (k for k in s if k.startswith("lmdb_") and k[5:].isdigit()),
            key=lambda k: int(k[5:]),
            default=None,
        )
        lm_txt = f", lmdb {s[lm]:.1f}x at {lm[5:]}" if lm else ""
        named = (
            ("host", "host"),
            ("host_layered", "host layered"),
            ("host_whole", "host whole blocks"),
            ("host_coalesced", "host coalesced"),
            ("host_lossless", "host lossless"),
            ("cost", "cost"),
        )
        txt = ", ".join(
            f"{label} {s[f'{m}_{top}']:.1f}x" for m, label in named if f"{m}_{top}" in s
        )
        parts.append(f"TTFT {top} tok vs recompute: {txt or '-'}{lm_txt};")
    for row in tt.get("lmdb", {}).values():
        parts.append(
            f"LMDB {row['length']} tok TTFT ms: recompute {row['recompute_ms']:.1f}, "
            f"pipelined {row['lmdb_ms']:.1f}, "
            + (f"serial {row['lmdb_serial_ms']:.1f}, " if "lmdb_serial_ms" in row else "")
            + f"overlap {row['lmdb_overlap_ms']:.1f}, "
            f"cost {row['lmdb_cost_ms']:.1f} ({row['cost_over_best']:.2f}x best);"
        )
    if "ttft_p50_ratio" in qa:
        parts.append(
            f"QA TTFT p50 {qa['ttft_p50_ratio']:.1f}x lower (rounds >= 1: "
            f"{qa['ttft_p50_later_rounds_ratio']:.1f}x), throughput "
            f"{qa['throughput_ratio']:.2f}x with offload"
            + (
                f" (lossless: {qa['lossless_ttft_p50_ratio']:.1f}x, "
                f"{qa['lossless_throughput_ratio']:.2f}x)"
                if "lossless_ttft_p50_ratio" in qa
                else ""
            )
            + ";"
        )
    if "points" in sw:
        parts.append(
            f"cost model within 5% of best at {sw['within_5pct']}/{sw['num_points']} "
            f"points (worst {sw['worst_ratio_to_best']:.2f}x), never slower than both "
            f"pure options at {sw.get('num_not_slower_than_both', '?')}/"
            f"{sw['num_points']}"
        )
    pp = res.get("pipeline", {})
    if "best" in pp:
        b = pp["variants"][pp["best"]]
        parts.append(
            f"LMDB load of {pp['num_blocks']} blocks: read {pp['read_ms']:.1f} ms, copy "
            f"{pp['copy_ms']:.1f} ms, serial {pp['variants']['serial']['ms']:.1f} ms, "
            f"{pp['best']} {b['ms']:.1f} ms ({b['over_max']:.2f}x max(read, copy), "
            f"{pp['best_over_serial']:.2f}x faster than serial);"
        )
    failed = [
        k
        for k in ("transfer", "load_path", "reload_steps", "ttft", "qa", "sweep", "pipeline")
        if "error" in res.get(k, {})
    ]
    if failed:
        parts.append(f"FAILED: {', '.join(failed)}")
    return " ".join(parts)


def _write(out_dir: str | None, res: dict[str, Any]) -> None:
    """DIR/offload.json (replaced whole, so a reader never sees half a file)."""
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "offload.json")
    with open(path + ".tmp", "w") as f:
        f.write(json.dumps(res, indent=2, default=str) + "\n")
    os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.offload", description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="directory for offload.json")
    ap.add_argument("--quick", action="store_true", help="demo model, small sizes (CPU-friendly)")
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="the full code path on a tiny random Llama (CPU-friendly)",
    )
    ap.add_argument(
        "--tiny-wide",
        action="store_true",
        help="--tiny with KV blocks of a real size (16 layers of Llama-3-8B's KV heads: 1 MiB)",
    )
    ap.add_argument("--lengths", help="TTFT prefix lengths, comma-separated (multiples of 16)")
    ap.add_argument("--sweep-lengths", help="sweep prefix lengths (default: the mode's)")
    ap.add_argument("--reps", type=int, help="TTFT repetitions per point (median reported)")
    ap.add_argument(
        "--warmup-reps",
        type=int,
        help="unmeasured repetitions before each TTFT point (default: 1 on the "
        "full run, 0 for --quick/--tiny)",
    )
    ap.add_argument("--lmdb-max-len", type=int, help="LMDB TTFT mode only up to this length")
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="ttft: every mode's engine alive at once, the modes taking turns each repetition",
    )
    ap.add_argument(
        "--request-log-dir", help="ttft: each engine's request log here (ttft_<mode>.jsonl)"
    )
    ap.add_argument("--qa-users", type=int, help="multi-round QA users")
    ap.add_argument("--qa-concurrency", type=int, help="multi-round QA requests in flight at most")
    ap.add_argument(
        "--qa-lossless",
        action="store_true",
        help="multi-round QA: also offload with compression: lossless (2-byte KV)",
    )
    ap.add_argument("--sections", default="transfer,load_path,reload_steps,ttft,qa,sweep")
    ap.add_argument(
        "--ttft-modes",
        default=",".join(DEFAULT_TTFT_MODES),
        help=f"ttft modes, comma-separated, from {list(TTFT_MODES)} (recompute always runs)",
    )
    ap.add_argument(
        "--suffix-tokens",
        type=int,
        help="ttft: new tokens after the reloaded prefix (default 16; a QA turn computes ~250)",
    )
    ap.add_argument(
        "--reload-modes",
        default=",".join(DEFAULT_RELOAD_MODES),
        help=f"reload_steps modes, comma-separated, from {sorted(RELOAD_MODES)}",
    )
    args = ap.parse_args(argv)
    sections = {
        "transfer": bench_transfer,
        "copy2d": bench_copy2d,
        "load_path": bench_load_path,
        "reload_steps": bench_reload_steps,
        "ttft": bench_ttft,
        "qa": bench_qa,
        "sweep": bench_sweep,
        "pipeline": bench_pipeline,
    }
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(sections))
    if unknown:
        ap.error(f"unknown sections {unknown}; choose from {sorted(sections)}")
    modes = tuple(m.strip() for m in args.reload_modes.split(",") if m.strip())
    if not modes or set(modes) - set(RELOAD_MODES):
        ap.error(
            f"unknown reload modes {sorted(set(modes) - set(RELOAD_MODES))}; choose "
            f"from {sorted(RELOAD_MODES)}"
        )
    ttft_modes = [m.strip() for m in args.ttft_modes.split(",") if m.strip()]
    if set(ttft_modes) - set(TTFT_MODES):
        ap.error(
            f"unknown ttft modes {sorted(set(ttft_modes) - set(TTFT_MODES))}; choose "
            f"from {list(TTFT_MODES)}"
        )
    if args.suffix_tokens is not None and args.suffix_tokens < 1:
        ap.error("--suffix-tokens must be at least 1")
    # recompute first: every other mode's speedup is over it
    ttft_modes = ["recompute", *(m for m in ttft_modes if m != "recompute")]
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-offload-") as workdir:
        mode = (
            "quick"
            if args.quick
            else "tiny"
            if args.tiny
            else "tiny_wide"
            if args.tiny_wide
            else "full"
        )
        setup = dataclasses.replace(
            build_setup(mode, workdir, args),
            reload_modes=modes,
            qa_lossless=args.qa_lossless,
            ttft_modes=tuple(ttft_modes),
        )
        res: dict[str, Any] = {
            "bench": "offload",
            "machine": machine_info(),
            "quick": args.quick,
            "mode": mode,
            "lengths": list(setup.lengths),
            "argv": sys.argv[1:] if argv is None else argv,
        }
        for name in chosen:
            t0 = time.perf_counter()
            try:
                res[name] = sections[name](setup)
            except Exception as exc:  # report and go on: one broken part must not hide the rest
                traceback.print_exc(file=sys.stderr)
                res[name] = {"error": f"{type(exc).__name__}: {exc}"}
            res[name]["section_s"] = time.perf_counter() - t0
            print(f"[offload] {name} done in {res[name]['section_s']:.1f}s", file=sys.stderr)
            _write(args.out, {**res, "partial": True})  # a run killed later keeps this much
        # The targets are for the H200 run; a quick run only reports its figures.
        res["targets"] = _targets(res, setup) if mode == "full" else {}
        summary = _summary(res, setup)
        res["summary"] = summary
    print(json.dumps(res, indent=2))
    _write(args.out, res)
    print(summary)
    return 1 if any("error" in res.get(k, {}) for k in chosen) else 0


if __name__ == "__main__":
    sys.exit(main())
