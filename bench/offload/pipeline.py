"""``pipeline`` section: a lower-tier (LMDB) load into the KV cache, pipelined vs serial.

N blocks of the Llama-3-8B shape (2 MiB each; ``--quick``/``--tiny`` on CPU: the same bytes)
live only in a page-cached LMDB tier under a 2-slot host tier. Each repetition times, in the
same process and interleaved (so a busy neighbour hits every variant alike):
- ``read``: the pipeline's read step alone (``LoadPipeline.read_chunk`` into staging);
- ``copy``: the staging -> cache copy alone (a raw ``copy_`` of the same bytes);
- ``serial``: the worker's load with ``load_chunk_bytes: 0`` (read all, then copy);
- ``pipelined`` for each (chunk blocks, depth) of the grid.
Medians are reported with each variant's own read and copy parts (the worker's ``read_s`` and
``copy_s``: chunked reads are not the one big read) as ``over_sum`` = time / (read + copy) and
``over_max`` = time / max(read, copy): the pipeline's goal is ``over_max`` near 1. The default chunk (``DEFAULT_CHUNK_BYTES``) and depth
are chosen from this grid. Usage: ``python -m bench.offload --sections pipeline [--quick]``.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

from bench.offload.parts import Setup, sync

GRID = ((8, 2), (16, 2), (32, 2), (64, 2), (32, 3))


def bench_pipeline(setup: Setup, reps: int = 5) -> dict[str, Any]:
    from cachestore.codec import HeaderTemplate, encode_block, encoded_size
    from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
    from connectors.offload.metadata import BlockLoad, KVConnectorMetadata
    from connectors.offload.pipeline import LoadPipeline
    from connectors.offload.worker import OffloadWorker, block_meta
    from engine.kv_cache import KVCache, KVCacheSpec
    from tiers import build_tiers
    from tiers.config import parse_tier_config

    dev = setup.device
    n = 128 if dev.type == "cuda" else 48  # 256 MiB / 96 MiB
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    kv = KVCache(spec, n + 2, dev)
    meta = block_meta(kv, "bench-pipeline")
    slot = encoded_size(meta, keyed=True)
    config = parse_tier_config(
        {
            "tiers": [
                {"kind": "host", "capacity": f"{2 * slot}B"},
                {
                    "kind": "lmdb",
                    "path": os.path.join(setup.workdir, "lmdb-pipeline"),
                    "capacity": f"{(n + 8) * slot * 2}B",
                },
            ]
        }
    )
    store = HierarchicalStore(
        build_tiers(config, host_slot_bytes=slot),
        StoreConfig(namespace=meta.namespace, promote_on_get=False),
    )
    gen = torch.Generator().manual_seed(3)
    payload = torch.randint(0, 255, (n, spec.bytes_per_block), generator=gen, dtype=torch.uint8)
    keys = tuple(f"{meta.namespace}/{i:064x}" for i in range(n))
    store.tiers[1].put_many(
        [(k, encode_block(memoryview(payload[i].numpy()), meta, key=k)) for i, k in enumerate(keys)]
    )
    ids = tuple(range(n))
    nbytes = n * spec.bytes_per_block
    variants: dict[str, OffloadWorker] = {"serial": _worker(kv, store, meta, 0, 2)}
    for chunk, depth in GRID:
        variants[f"pipelined_c{chunk}_d{depth}"] = _worker(kv, store, meta, chunk, depth)
    # the worker's read step: whole encoded blocks read in place (the payload copied out after)
    probe = LoadPipeline(
        kv, store, None, chunk_blocks=n, depth=1, headers=HeaderTemplate(meta, keyed=True)
    )
    staging = torch.empty((n, slot), dtype=torch.uint8, pin_memory=dev.type == "cuda")
    head = HeaderTemplate(meta, keyed=True).size
    payloads = staging[:, head : head + spec.bytes_per_block]
    rows = kv.byte_rows()

    parts: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}

    def load(name: str) -> None:
        spec = store.prepare_load(keys)
        variants[name].start_load_kv(
            KVConnectorMetadata(
                loads=(BlockLoad("bench", ids, keys, 0, ("lmdb",) * n, spec=spec),),
                num_scheduled_requests=0,
            )
        )
        [done] = variants[name].take_report().finished_loads
        assert done.num_loaded_blocks == n, done
        parts[name].append((done.read_s, done.copy_s))

    cases = {
        "read": lambda: probe.read_chunk(keys, staging),
        "copy": lambda: rows[:n].copy_(payloads, non_blocking=dev.type == "cuda"),
        **{name: (lambda name=name: load(name)) for name in variants},
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for fn in cases.values():  # warm-up: page cache, pinned ring, kernels
            fn()
        correct = bool(torch.equal(rows[:n].cpu(), payload))
        for _ in range(reps):
            for name, fn in cases.items():  # interleaved
                sync(dev)
                t0 = time.perf_counter()
                fn()
                sync(dev)
                times[name].append(time.perf_counter() - t0)
    finally:
        for worker in variants.values():
            worker.close()
        probe.close()
        store.close()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    read, copy = med["read"], med["copy"]
    rows_out = {}
    for name in variants:
        t = med[name]
        # The variant's own read and copy parts (its chunked reads are not the one big read).
        own_read = statistics.median(r for r, _ in parts[name][1:])
        own_copy = statistics.median(c for _, c in parts[name][1:])
        rows_out[name] = {
            "ms": t * 1e3,
            "gbps": nbytes / t / 1e9,
            "read_ms": own_read * 1e3,
            "copy_ms": own_copy * 1e3,
            "over_sum": t / (own_read + own_copy),
            "over_max": t / max(own_read, own_copy),
        }
    best = min((k for k in rows_out if k.startswith("pipelined")), key=lambda k: med[k])
    return {
        "num_blocks": n,
        "block_bytes": spec.bytes_per_block,
        "device": str(dev),
        "reps": reps,
        "bytes_correct": correct,
        "read_ms": read * 1e3,
        "copy_ms": copy * 1e3,
        "variants": rows_out,
        "best": best,
        "best_over_serial": med["serial"] / med[best],
    }


def _worker(kv: Any, store: Any, meta: Any, chunk: int, depth: int) -> Any:
    from connectors.offload.stats import OffloadStats
    from connectors.offload.worker import OffloadWorker

    return OffloadWorker(
        kv,
        store,
        meta,
        load_timeout_s=600.0,
        stats=OffloadStats(),
        load_chunk_bytes=chunk * kv.bytes_per_block,
        load_pipeline_depth=depth,
    )
