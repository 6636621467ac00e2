"""``--kv-offload``: the KV connector from the engine's GPU block pool to the tier stack.

``OffloadConnector.create`` builds the hierarchical store from the offload config (or the
defaults), sizes the host tier's slots to the encoded block (codec header + ``bytes_per_block``),
and wires the two sides: ``scheduler`` (``OffloadScheduler``: the block pool's listener and the
scheduler's connector) and ``worker`` (``OffloadWorker``: the model runner's connector). The
worker's report of each step rides the runner's output to the scheduler side
(``KVConnectorOutput``, taken in ``Scheduler.update_from_output``); ``observe_step`` feeds the
cost model each step that was one prefill chunk alone.

Start-up calibration (``calibrate: true`` in the config, the default): before the connector is
attached, the cost model's priors are replaced by measurements (``cachestore.cost.calibration``):
a few prefill sizes through the real runner on scratch blocks (``CalibrationTarget``), each
tier's batched read of real-sized encoded blocks (written under a private prefix and deleted),
and the host -> device scatter. A tqdm bar shows progress on stderr; the result is logged.

Lifecycle: ``flush`` writes every block freed since the last step and waits for the store's
demotions and write-through copies (``LLM.generate`` calls it when done, so that a restarted or
another engine finds everything); ``close`` flushes, drains the write-through queues and
flushes host-only blocks down to the first tier below the host (``drain_timeout_s`` bounds each
of the two; ``HierarchicalStore.shutdown_writes`` logs what it wrote and dropped), stops the
load thread and closes the store (and its tiers). Not thread-safe: the engine thread drives it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from cachestore.codec import PAYLOAD_ALIGN, encoded_size
from cachestore.cost.calibration import calibrate
from cachestore.cost.model import Strategy
from cachestore.cost.online import CostPriors, OnlineCostModel, default_priors
from cachestore.cost.placement import unprofitable_tiers
from cachestore.hashing import Namespace
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from cachestore.store.types import write_policies
from connectors.device.kv_compress import Hi4Codec
from connectors.offload import calibration as cal
from connectors.offload import tp as tp_offload  # builds on this class, handed to it
from connectors.offload.config import (
    OffloadConfig,
    default_offload_config,
    load_offload_config,
    warn_lmcache_settings,
)
from connectors.offload.metadata import KVConnectorMetadata
from connectors.offload.pipeline import pipeline_readers
from connectors.offload.scheduler import OffloadScheduler
from connectors.offload.stats import OffloadStats
from connectors.offload.worker import OffloadWorker, block_meta
from engine.core_types import SchedulerOutput
from engine.kv_cache import KVCache
from engine.kv_connector import CalibrationTarget
from engine.request import Request
from tiers import build_tiers

log = logging.getLogger(__name__)


class OffloadConnector:
    def __init__(
        self,
        config: OffloadConfig,
        store: HierarchicalStore,
        kv_cache: KVCache,
        namespace: Namespace,
        cost_model: OnlineCostModel,
    ) -> None:
        """Takes ownership of ``store`` (``close`` closes it). Raises ValueError when the
        config's compression cannot apply to this cache."""
        self.config = config
        self.store = store
        self.cost_model = cost_model
        self.counters = OffloadStats()
        codec = _codec(config, kv_cache)
        namespace = _stored_namespace(namespace, codec)
        meta = block_meta(kv_cache, namespace.store_prefix(), codec)
        self.scheduler = OffloadScheduler(
            store,
            namespace,
            decision=config.decision,
            cost_model=cost_model,
            stats=self.counters,
            block_meta=meta,
            in_step=config.in_step_host_loads,
            in_step_per_step=config.in_step_loads_per_step,
            prefetch_budget_blocks=_prefetch_budget(config, store),
        )
        self.worker = OffloadWorker(
            kv_cache,
            store,
            meta,
            load_timeout_s=config.load_timeout_s,
            stats=self.counters,
            cost_model=cost_model,
            layered_loads=config.layer_wise,
            layers_per_copy=config.layers_per_copy,
            load_issue_ahead=config.load_issue_ahead,
            coalesced_loads=config.coalesced_loads,
            codec=codec,
            load_chunk_bytes=config.load_chunk_bytes,
            load_pipeline_depth=config.load_pipeline_depth,
            load_read_threads=config.load_read_threads,
            hold_async_copies=config.async_copies_after_forward,
        )
        if config.in_step_host_loads and self.worker.layered_loads:
            # In-step host loads land layer by layer under the forward: price them so.
            cost_model.pipelined_layers = self.worker.load_stages
        self._closed = False

    @classmethod
    def create(
        cls,
        source: str | os.PathLike[str] | Mapping[str, Any] | OffloadConfig | None,
        kv_cache: KVCache,
        namespace: Namespace,
        *,
        calibration: CalibrationTarget | None = None,
        tp: Any = None,
    ) -> Any:
        """Build from a YAML path, a dict, an ``OffloadConfig`` or None (the defaults).
        ``tp`` (the engine's tensor-parallel driver) or a ``kv_head_group`` that splits this
        cache's heads: the connector of connectors/offload/tp.py, one worker per rank and
        head group.
        With ``config.calibrate``, measure the priors first (prefill only when ``calibration``
        is given; the tiers and the host hop always). Call before the worker is attached to the
        runner and before any request: calibration uses the cache's blocks as scratch.
        Raises ConfigError on a bad config; a tier that cannot be built raises its error."""
        config = resolve_config(source, namespace)
        warn_lmcache_settings()
        if tp is not None or 0 < config.kv_head_group < kv_cache.spec.num_kv_heads:
            return tp_offload.create_tp_connector(cls, config, kv_cache, namespace, calibration, tp)
        codec = _codec(config, kv_cache)
        prefix = _stored_namespace(namespace, codec).store_prefix()
        meta = block_meta(kv_cache, prefix, codec)
        # Slots of a multiple of PAYLOAD_ALIGN bytes: every payload in the slab starts 16-byte
        # aligned (the layer-wise load kernel reads it in 16-byte words).
        slot = -(-encoded_size(meta, keyed=True) // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
        tiers = build_tiers(config.tiers, host_slot_bytes=slot)
        store = HierarchicalStore(
            tiers,
            StoreConfig(
                namespace=prefix,
                write_policies=write_policies(config.tiers),
                probe_interval_s=config.health_probe_s,
            ),
        )
        kind = "cpu" if kv_cache.device.type == "cpu" else "h200-llama-3-8b"
        base = default_priors(kind)
        priors = CostPriors(
            kind, dict(base.tier_costs), base.prefill, kv_cache.bytes_per_block, kv_cache.block_size
        )
        try:
            if config.calibrate:
                cost_model = _calibrate(
                    store,
                    kv_cache,
                    priors,
                    encoded_size(meta, keyed=True),
                    calibration,
                    codec,
                    readers=pipeline_readers(config.load_read_threads),
                )
            else:
                cost_model = OnlineCostModel.from_priors(priors)
        except BaseException:
            store.close()
            raise
        if config.placement == "worth_loading":
            _place(store, cost_model, kv_cache)
        return cls(config, store, kv_cache, namespace, cost_model)

    @staticmethod
    def create_rank(spec: Any, kv_cache: KVCache, rank: int, size: int) -> Any:
        """Tensor-parallel rank ``rank``'s share (connectors/offload/tp.py), from what rank 0
        sent (``spec``)."""
        return tp_offload.create_rank_connector(OffloadConnector, spec, kv_cache, rank, size)

    @staticmethod
    def check_config(source: str | os.PathLike[str] | Mapping[str, Any] | None) -> None:
        """Parse ``source`` and check this machine can hold its tiers (host memory, LMDB
        directory: ``tiers.config.check_resources``) without building any. Raises
        ConfigError naming the file, the tier and the field."""
        if source is None or isinstance(source, OffloadConfig):
            return
        from tiers.config import check_resources

        check_resources(load_offload_config(source).tiers)

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        """Feed the cost model a step that was one prefill chunk alone (a clean sample) and
        sampled: on CUDA a step's only synchronization is the copy of its sampled tokens, so a
        chunk that samples nothing (a long prompt's first chunks) returns once its kernels are
        enqueued, and its wall time is not its compute time. On an H200 such chunks taught the
        prefill model ~2x too fast a rate (4.3K tokens priced at 41 ms that took ~90 alone)."""
        meta = output.kv_connector_metadata
        if isinstance(meta, KVConnectorMetadata) and meta.loads:
            return  # an in-step load's copies ran inside this step: not a pure prefill
        if len(output.requests) == 1:
            r = output.requests[0]
            if len(r.token_ids) > 1 and r.sample:
                self.cost_model.observe_prefill(len(r.token_ids), r.num_computed_tokens, seconds)

    def observe_first_token(self, request: Request, phases: Mapping[str, float]) -> None:
        """A priced plan's outcome for the cost model (``observe_outcome``): its load, wait
        and compute phases against the price (queueing and scheduling are not priced). Only
        a plan that ran as planned: one whose load was dropped (recomputed instead) is not
        its strategy's outcome.

        The price is for the plan alone, and its steps may have carried other requests'
        tokens (decodes, others' prompt chunks), which slow whichever plan meets them. So the
        price it is measured against is the plan's plus the prefill model's price of those
        tokens (``OnlineCostModel.step_share_s``): every strategy is measured, each against
        the steps it actually ran in. Before, an outcome whose steps carried more than 64
        other tokens taught nothing: on an H200 with the QA client and a 2 GiB host tier over
        LMDB, recompute's chunks always shared their steps and it was never measured (priced
        85 ms for ~4.3K tokens, it took 166-497 ms), while a load's short step of its own
        was: one cold first load at 3.0x its price made 41 of the next 45 reused requests
        recompute."""
        plan = request.kv_plan
        if not plan or plan.get("predicted_s", 0.0) <= 0.0:
            return
        loaded = plan.get("load_tokens", 0) > 0
        if loaded != (request.kv_decision != Strategy.RECOMPUTE):
            return
        own = plan.get("head_tokens", 0) + plan.get("recompute_tokens", 0)
        others = max(request.times.prefill_step_tokens - own, 0)
        if others:
            self.counters.add(shared_step_outcomes=1)
        measured = sum(phases.get(k, 0.0) for k in ("load", "prefill_wait", "prefill_compute"))
        self.cost_model.observe_outcome(
            request.kv_decision,
            request.num_prompt_tokens,
            plan["predicted_s"] + self.cost_model.step_share_s(others),
            measured,
        )

    def save_pending(self) -> None:
        """Write every block freed since the last step to the host tier now, waiting neither
        for their seals nor for the copies down (an engine going idle: no next step would save
        them; they are visible once the seal thread is through them). Call only between
        steps."""
        self.worker.save_now(self.scheduler.take_pending_saves(), wait=False)

    def flush(self) -> None:
        """Write out every block freed since the last step, then wait for demotions and for
        the write-through copies (those for up to ``drain_timeout_s``). Call only between
        steps."""
        meta = self.scheduler.take_pending_saves()
        self.worker.save_now(meta)
        self.store.flush(self.config.drain_timeout_s)

    def stats(self) -> dict[str, Any]:
        """Connector counters (``OffloadStats``), the store's per-tier stats and the cost
        model's snapshot. No side effect."""
        out = self.counters.snapshot()
        store = self.store.stats()
        for row in store["tiers"]:
            tier = out["tiers"].setdefault(row["name"], {"hit_blocks": 0})
            for name in _WRITE_COUNTERS:
                tier[name] = row[name]
        out["store"] = store
        out["cost_model"] = self.cost_model.snapshot()
        out["decision_policy"] = self.config.decision
        return out

    def close(self) -> None:
        """Flush, drain the write policy's queues and flush host-only blocks down
        (``HierarchicalStore.shutdown_writes``), stop the worker, close the store and its tiers.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            meta = self.scheduler.take_pending_saves()
            self.worker.save_now(meta)
            self.store.shutdown_writes(self.config.drain_timeout_s)
        finally:
            if self.scheduler.prefetcher is not None:
                self.scheduler.prefetcher.close()
            self.worker.close()
            self.store.close()


def resolve_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | OffloadConfig | None, namespace: Namespace
) -> OffloadConfig:
    """The config ``source`` names (None: the defaults, an LMDB under the store prefix)."""
    if source is None:
        return default_offload_config(namespace.store_prefix())
    if isinstance(source, OffloadConfig):
        return source
    return load_offload_config(source)


# Per-tier write-policy counters also shown beside each tier's hit_blocks in ``stats()``.
_WRITE_COUNTERS = ("written_through", "written_back", "write_queue_dropped", "write_queue_depth")


def _prefetch_budget(config: OffloadConfig, store: HierarchicalStore) -> int:
    """Blocks prefetches may pin at once: the config's, else a quarter of the host slots."""
    slab = store.host_slab()
    if not config.prefetch or slab is None:
        return 0
    return config.prefetch_budget_blocks or max(slab.num_slots // 4, 1)  # type: ignore[attr-defined]


def _codec(config: OffloadConfig, kv_cache: KVCache) -> Hi4Codec | None:
    """The stored block format the config asks for (None: raw blocks), its decode kernels
    compiled on the cache's device before the first reload needs them (``Hi4Codec.warm``)."""
    if config.compression != "lossless":
        return None
    codec = Hi4Codec.for_cache(kv_cache)
    codec.warm(kv_cache.device)
    return codec


def _stored_namespace(namespace: Namespace, codec: Hi4Codec | None) -> Namespace:
    """Keys of compressed blocks get their own prefix: an engine storing raw blocks and one
    storing compressed ones may share tiers without reading each other's format."""
    return namespace if codec is None else dataclasses.replace(namespace, kv_format=codec.name)


def _place(store: HierarchicalStore, cost_model: OnlineCostModel, kv_cache: KVCache) -> None:
    """``placement: worth_loading``: tiers no prefix the cache can hold would be worth loading
    from are skipped by demotion (``HierarchicalStore.skip_tiers``), each logged with its
    figures."""
    verdicts = unprofitable_tiers(
        cost_model.tier_costs(),
        cost_model.prefill_cost(),
        block_bytes=kv_cache.bytes_per_block,
        block_tokens=kv_cache.block_size,
        max_prefix_tokens=max(kv_cache.num_blocks, 1) * kv_cache.block_size,
    )
    for v in verdicts:
        log.info(
            "kv placement: not writing to %s: a %d-token prefix loads in %.1f ms there, "
            "recomputes in %.1f ms",
            v.name,
            v.prefix_tokens,
            v.load_s * 1e3,
            v.recompute_s * 1e3,
        )
    store.skip_tiers([v.name for v in verdicts])


def _calibrate(
    store: HierarchicalStore,
    kv_cache: KVCache,
    priors: CostPriors,
    encoded_block_bytes: int,
    target: CalibrationTarget | None,
    codec: Hi4Codec | None = None,
    readers: int = 1,
) -> OnlineCostModel:
    """Measure prefill (when ``target`` is given), every tier but host, and the host hop;
    log the result. Leaves the scratch blocks zeroed and the runner without state."""
    t0 = time.perf_counter()
    num_blocks = min(16 if kv_cache.device.type == "cuda" else 8, kv_cache.num_blocks)
    host_to_gpu = cal.host_to_gpu_timer(kv_cache, num_blocks, codec) if num_blocks >= 2 else None
    run_prefill, sizes, scratch = None, cal.DEFAULT_PREFILL_SIZES, num_blocks
    if target is not None:
        total, new = cal.max_prefill_shape(kv_cache, target.max_model_len, target.token_budget)
        if new >= 32:
            sizes = cal.prefill_sizes(total, new)
            run_prefill = cal.prefill_timer(target.execute, kv_cache.block_size, target.vocab_size)
            scratch = max(scratch, -(-max(n + c for n, c in sizes) // kv_cache.block_size))
    try:
        model = calibrate(
            store.tiers,
            kv_cache.bytes_per_block,
            kv_cache.block_size,
            run_prefill,
            host_to_gpu=host_to_gpu,
            priors=priors,
            prefill_sizes=sizes,
            num_blocks=max(num_blocks, 2),
            tier_block_bytes=encoded_block_bytes,
            tier_readers=readers,
        )
    finally:
        if target is not None:
            cal.finish(target.execute, kv_cache, min(scratch, kv_cache.num_blocks))
        elif host_to_gpu is not None:
            kv_cache.tensor[:num_blocks].zero_()
    log.info("kv offload calibrated in %.2fs: %s", time.perf_counter() - t0, describe(model))
    return model


def describe(model: OnlineCostModel) -> str:
    """One line: every tier's latency and bandwidth, and the prefill fit."""
    p = model.prefill_cost()
    tiers = ", ".join(
        f"{name} {c.latency_s * 1e6:.0f}us {c.bandwidth_bytes_per_s / 1e9:.2f}GB/s"
        for name, c in model.tier_costs().items()
    )
    return (
        f"{tiers}; prefill {p.fixed_s * 1e3:.2f}ms + {p.per_token_s * 1e6:.2f}us/token "
        f"+ {p.attention_s * 1e9:.3f}ns*n*(c+n/2)"
    )
