"""bench/offload/main.py's cost-model sweep: a throttled LMDB tier behind the engine's own load path
(store -> staging thread -> host slab -> one copy per block), its calibration through that same
path, the measured parts of each option, and the section itself (the model's choice against the
measured best at each prefix length x tier speed).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.offload.parts import (
    GREEDY1,
    Setup,
    _ttft_once,
    close_llm,
    make_llm,
    random_tokens,
    run_requests,
    sync,
)
from cachestore.cost.calibration import calibrate_prefill, calibrate_transfer
from cachestore.cost.model import Strategy
from cachestore.cost.online import OnlineCostModel
from engine.kv_cache import KVCache
from tiers.base import Evicted, Tier, TierUsage, Value

# -- cost-model sweep parts -------------------------------------------------------------


class ThrottledTier(Tier):
    """A tier whose reads take at least ``latency_s + nbytes / bandwidth`` (it sleeps the rest).
    A read already slower than that is not sped up, so per-block costs of the inner tier cap
    the rate it reaches (the sweep reports the fitted, effective rate). Writes, lookups,
    deletes and pins pass through. Thread-safe as the inner tier."""

    def __init__(self, inner: Tier, latency_s: float, bandwidth_bytes_per_s: float) -> None:
        self.inner, self.latency_s, self.bandwidth = inner, latency_s, bandwidth_bytes_per_s
        self.name = inner.name

    def lookup(self, keys: Sequence[str]) -> int:
        return self.inner.lookup(keys)

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        t0 = time.perf_counter()
        values = self.inner.get_many(keys)
        nbytes = sum(len(v) for v in values if v is not None)
        rest = self.latency_s + nbytes / self.bandwidth - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)
        return values

    def put_many(self, items: Sequence[tuple[str, Value]]) -> list[Evicted]:
        return self.inner.put_many(items)

    def delete_many(self, keys: Sequence[str]) -> int:
        return self.inner.delete_many(keys)

    def pin_each(self, keys: Sequence[str]) -> list[bool]:  # the store pins loads in LMDB
        return self.inner.pin_each(keys)  # type: ignore[attr-defined, no-any-return]

    def unpin(self, keys: Sequence[str]) -> None:
        self.inner.unpin(keys)  # type: ignore[attr-defined]

    def usage(self) -> TierUsage:
        return self.inner.usage()

    def close(self) -> None:
        self.inner.close()


class SweepLoads:
    """The sweep's loads, through the engine's own lower-tier load path: a HierarchicalStore
    of a host tier (the slab; pinned on CUDA) over a throttled LMDB tier holding ``num_blocks``
    encoded blocks, and the connector's ``OffloadWorker`` loading into a KV cache of its own
    (the engine's cache keeps the measured prefill contexts). A load is what an async load of
    blocks demoted to LMDB does: ``prepare_load``, ``start_load_kv`` on an idle step (the
    staging thread reads them from LMDB with checksums into slab slots, then one slab -> cache
    copy per block), ``take_report``. Every load is cold: its blocks are first dropped from the
    host tier (LMDB keeps them), so calibration and the timed loads read the same way.
    Not thread-safe; owns its tiers (``close``)."""

    def __init__(self, kv: KVCache, lmdb_path: str, num_blocks: int) -> None:
        from cachestore.codec import encode_block, encoded_size
        from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
        from connectors.offload.stats import OffloadStats
        from connectors.offload.worker import OffloadWorker, block_meta
        from tiers.host import HostTier
        from tiers.lmdb import LmdbTier

        self.kv, self.device = kv, kv.device
        meta = block_meta(kv, "bench-sweep")
        slot = encoded_size(meta, keyed=True)  # blocks carry their key, as the engine's do
        self.keys = [f"{meta.namespace}/{i:064x}" for i in range(num_blocks)]
        self.lmdb = LmdbTier(lmdb_path, (num_blocks + 16) * (slot + 4096) * 2)
        rng = random.Random(5)  # seeded payloads; nothing computes on them
        for i in range(0, num_blocks, 32):
            self.lmdb.put_many(
                [
                    (k, encode_block(rng.randbytes(kv.bytes_per_block), meta, key=k))
                    for k in self.keys[i : i + 32]
                ]
            )
        self.tier = ThrottledTier(self.lmdb, 0.0, float("inf"))
        self.host = HostTier((num_blocks + 4) * slot, slot)
        self.store = HierarchicalStore(
            [self.host, self.tier], StoreConfig(namespace=meta.namespace, promote_on_get=False)
        )
        self.worker = OffloadWorker(
            kv, self.store, meta, load_timeout_s=600.0, stats=OffloadStats()
        )

    def throttle(self, latency_s: float, bandwidth_bytes_per_s: float) -> None:
        self.tier.latency_s, self.tier.bandwidth = latency_s, bandwidth_bytes_per_s

    def load(self, begin: int, end: int) -> float:
        """Seconds to load blocks ``[begin, end)`` from LMDB into cache blocks ``[0, n)``.
        Raises RuntimeError when fewer blocks arrive."""
        from connectors.offload.metadata import BlockLoad, KVConnectorMetadata

        keys = tuple(self.keys[begin:end])
        n = len(keys)
        self.host.delete_many(keys)  # cold: LMDB serves them (untimed)
        sync(self.device)
        t0 = time.perf_counter()
        spec = self.store.prepare_load(keys)
        self.worker.start_load_kv(
            KVConnectorMetadata(
                loads=(BlockLoad("sweep", tuple(range(n)), keys, 0, ("lmdb",) * n, spec=spec),),
                num_scheduled_requests=0,
            )
        )
        finished = self.worker.take_report().finished_loads
        sync(self.device)
        seconds = time.perf_counter() - t0
        if [f.num_loaded_blocks for f in finished] != [n]:
            raise RuntimeError(f"sweep load of {n} blocks: {finished}")
        return seconds

    def timer(self) -> Callable[[int], float]:
        """``load_blocks(n)`` for ``calibrate_transfer``: the leading ``n`` blocks, cold."""
        return lambda n: self.load(0, n)

    def close(self) -> None:
        self.worker.close()
        self.store.close()


def calibration_sizes(num_blocks: int) -> tuple[int, ...]:
    """Batch sizes the sweep calibrates a tier at for a prefix of ``num_blocks`` blocks: an
    eighth, a half and all of it (what the timed loads move), at least 1 block each."""
    return tuple(sorted({max(num_blocks // 8, 1), max(num_blocks // 2, 1), num_blocks}))


class _Parts:
    """Measured building blocks of the sweep: prefill(n | c) on the engine (offload off, the
    context held in the GPU prefix cache) and cold loads of blocks ``[begin, end)`` through
    ``SweepLoads`` (the engine's lower-tier load path)."""

    def __init__(self, setup: Setup, llm: Any, lmdb_path: str, num_blocks: int) -> None:
        self.setup, self.llm = setup, llm
        spec = llm.engine.runner.kv_cache.spec
        self.bpb = spec.bytes_per_block
        self.loads = SweepLoads(KVCache(spec, num_blocks, setup.device), lmdb_path, num_blocks)
        self.rng = random.Random(3)
        self._prefill: dict[tuple[int, int], float] = {}
        self._contexts: dict[int, list[int]] = {}

    def prefill(self, n: int, c: int) -> float:
        """Best of 2 TTFTs of ``n`` new tokens after ``c`` cached ones (memoized)."""
        if (n, c) not in self._prefill:
            ctx = self._contexts.setdefault(c, random_tokens(self.rng, c))
            times = []
            for _ in range(2):
                if c:
                    run_requests(
                        self.llm,
                        [ctx + random_tokens(self.rng, 1)],
                        GREEDY1,
                        self.setup.request_timeout_s,
                    )  # cache the context
                t, cached = _ttft_once(
                    self.llm, ctx + random_tokens(self.rng, n), self.setup.request_timeout_s
                )
                if cached < c:
                    raise RuntimeError(f"context of {c} tokens not cached ({cached})")
                times.append(t)
            self._prefill[(n, c)] = min(times)
        return self._prefill[(n, c)]

    def load(self, begin: int, end: int) -> float:
        """Seconds of one cold load of blocks ``[begin, end)`` (0 for none)."""
        return self.loads.load(begin, end) if end > begin else 0.0

    def close(self) -> None:
        self.loads.close()


# -- cost-model sweep ----------------------------------------------------------------------


def _sweep_prefill_sizes(lengths: tuple[int, ...]) -> list[tuple[int, int]]:
    """(new, context) shapes the sweep fits its prefill model to: for each prefix ``L``, the
    shapes its options price: recompute ``(L+16 | 0)``, the rest after load-all ``(16 | L)``,
    overlap heads ``(L/4 | 0)`` and ``(L/2 | 0)``, the rest of a half load ``(L/2+16 | L/2)``.
    (The fit is relative: short shapes count as much as long ones.)"""
    return list(
        dict.fromkeys(
            s
            for n in lengths
            for s in ((n // 4, 0), (n // 2, 0), (n + 16, 0), (16, n), (n // 2 + 16, n // 2))
        )
    )


def bench_sweep(setup: Setup) -> dict[str, Any]:
    """Prefix length x tier speed: for each point the cost model is calibrated on the tier as
    the sweep reads it (``calibrate_transfer`` of ``SweepLoads``' cold engine load path at an
    eighth, half and all of the prefix's blocks) and its choice is timed from measured parts
    against recompute and load-all. The axis is the throttle's nominal bandwidth (a multiple of
    the break-even) and the effective bandwidth the path reaches (the fit): per-block costs
    cap it. ``path_ceiling``: the unthrottled path's fit."""
    lengths = setup.sweep_lengths or setup.lengths
    max_blocks = max(lengths) // 16
    # Room for a context and its new tokens at every length and calibration size (<= 4K).
    llm = make_llm(setup, max(3 * max(lengths), 4096) // 16 + 16, None)
    points: list[dict[str, Any]] = []
    parts: _Parts | None = None
    try:
        parts = _Parts(setup, llm, os.path.join(setup.workdir, "sweep-lmdb"), max_blocks)
        bpb = parts.bpb
        run_requests(
            llm, [random_tokens(parts.rng, 64)], GREEDY1, setup.request_timeout_s
        )  # warm-up
        prefill = calibrate_prefill(
            parts.prefill, _sweep_prefill_sizes(lengths), progress=False, relative=True
        )
        ceiling = calibrate_transfer(
            parts.loads.timer(), bpb, "lmdb", sizes=calibration_sizes(max_blocks)
        )
        for length in lengths:
            k_all = length // 16
            recompute = parts.prefill(length + 16, 0)
            breakeven_bw = k_all * bpb / recompute
            for bw_factor, lat_factor in setup.sweep_factors:
                parts.loads.throttle(lat_factor * recompute, bw_factor * breakeven_bw)
                fit = calibrate_transfer(
                    parts.loads.timer(), bpb, "lmdb", sizes=calibration_sizes(k_all)
                )
                # No "host" hop: the fit is the whole load (staging, then slab -> cache copies).
                model = OnlineCostModel({"lmdb": fit.cost}, prefill, bpb, 16)
                d = model.decide(0, ["lmdb"] * k_all, length + 16)
                read_all = parts.load(0, k_all)
                load_all = read_all + parts.prefill(16, length)
                b = d.best
                if b.strategy == Strategy.RECOMPUTE:
                    chosen = recompute
                elif b.strategy == Strategy.OVERLAP:
                    chosen = max(
                        parts.prefill(16 * b.load_begin, 0), parts.load(b.load_begin, b.load_end)
                    ) + parts.prefill(16, length)
                else:
                    done = 16 * b.load_end
                    chosen = parts.load(0, b.load_end) + parts.prefill(length + 16 - done, done)
                best = min(recompute, load_all, chosen)
                points.append(
                    {
                        "prefix_tokens": length,
                        "bandwidth_gbps": fit.cost.bandwidth_bytes_per_s / 1e9,  # effective
                        "latency_s": fit.cost.latency_s,  # effective
                        "nominal_gbps": bw_factor * breakeven_bw / 1e9,
                        "nominal_latency_s": lat_factor * recompute,
                        "calibration": [[s.num_blocks, s.seconds] for s in fit.samples],
                        "choice": b.strategy,
                        "load_blocks": [b.load_begin, b.load_end],
                        "predicted_s": d.predicted_s,
                        "predicted_recompute_s": prefill.time(length + 16, 0),
                        "predicted_load_all_s": fit.predict(k_all, bpb) + prefill.time(16, length),
                        "read_all_s": read_all,
                        "predicted_read_all_s": fit.predict(k_all, bpb),
                        "recompute_s": recompute,
                        "load_all_s": load_all,
                        "chosen_s": chosen,
                        "ratio_to_best": chosen / best,
                        "not_slower_than_both": chosen <= max(recompute, load_all) * 1.02,
                    }
                )
    finally:
        if parts is not None:
            parts.close()
        close_llm(llm)
    ratios = [p["ratio_to_best"] for p in points]
    return {
        "points": points,
        "worst_ratio_to_best": max(ratios),
        "within_5pct": sum(r <= 1.05 for r in ratios),
        "num_points": len(points),
        "never_slower_than_both": all(p["not_slower_than_both"] for p in points),
        "num_not_slower_than_both": sum(p["not_slower_than_both"] for p in points),
        # Which side of the model misses: the calibrated load, or the prefill fit.
        "worst_read_prediction_error": max(
            abs(p["predicted_read_all_s"] / p["read_all_s"] - 1) for p in points
        ),
        "worst_recompute_prediction_error": max(
            abs(p["predicted_recompute_s"] / p["recompute_s"] - 1) for p in points
        ),
        "path_ceiling": {
            "gbps": ceiling.cost.bandwidth_bytes_per_s / 1e9,
            "latency_s": ceiling.cost.latency_s,
            "block_bytes": bpb,
            "calibration": [[s.num_blocks, s.seconds] for s in ceiling.samples],
        },
        "prefill_fit": {
            "fixed_s": prefill.fixed_s,
            "per_token_s": prefill.per_token_s,
            "attention_s": prefill.attention_s,
        },
    }
