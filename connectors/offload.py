"""``--kv-offload``: the KV connector from the engine's GPU block pool to the tier stack.

``OffloadConnector.create`` builds the hierarchical store from the offload config (or the
defaults), sizes the host tier's slots to the encoded block (codec header + ``bytes_per_block``),
and wires the two sides: ``scheduler`` (``OffloadScheduler``: the block pool's listener and the
scheduler's connector) and ``worker`` (``OffloadWorker``: the model runner's connector). The
engine hands the worker's report to the scheduler side after each step (``after_step``).

Lifecycle: ``flush`` writes every block freed since the last step and waits for the store's
demotions (an idle engine calls it so that a restarted engine finds everything); ``close``
flushes, stops the load thread and closes the store (and its tiers). Not thread-safe: the
engine thread drives it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from cachestore.codec import encoded_size
from cachestore.cost_online import OnlineCostModel, default_priors
from cachestore.hashing import Namespace
from cachestore.store import HierarchicalStore, StoreConfig
from cachestore.tier_config import build_tiers
from connectors.base import WorkerReport
from connectors.offload_config import OffloadConfig, default_offload_config, load_offload_config
from connectors.offload_scheduler import OffloadScheduler
from connectors.offload_stats import OffloadStats
from connectors.offload_worker import OffloadWorker, block_meta
from engine.kv_cache import KVCache


class OffloadConnector:
    def __init__(
        self,
        config: OffloadConfig,
        store: HierarchicalStore,
        kv_cache: KVCache,
        namespace: Namespace,
        cost_model: OnlineCostModel,
    ) -> None:
        """Takes ownership of ``store`` (``close`` closes it)."""
        self.config = config
        self.store = store
        self.cost_model = cost_model
        self.counters = OffloadStats()
        self.scheduler = OffloadScheduler(
            store, namespace, decision=config.decision, cost_model=cost_model, stats=self.counters
        )
        self.worker = OffloadWorker(
            kv_cache,
            store,
            block_meta(kv_cache, namespace.key_prefix()),
            load_timeout_s=config.load_timeout_s,
            stats=self.counters,
            cost_model=cost_model,
        )
        self._closed = False

    @classmethod
    def create(
        cls,
        source: str | os.PathLike[str] | Mapping[str, Any] | OffloadConfig | None,
        kv_cache: KVCache,
        namespace: Namespace,
    ) -> OffloadConnector:
        """Build from a YAML path, a dict, an ``OffloadConfig`` or None (the defaults).
        Raises ConfigError on a bad config; a tier that cannot be built raises its error."""
        prefix = namespace.key_prefix()
        if source is None:
            config = default_offload_config(prefix)
        elif isinstance(source, OffloadConfig):
            config = source
        else:
            config = load_offload_config(source)
        meta = block_meta(kv_cache, prefix)
        tiers = build_tiers(config.tiers, host_slot_bytes=encoded_size(meta))
        store = HierarchicalStore(tiers, StoreConfig(namespace=prefix))
        priors = default_priors("cpu" if kv_cache.device.type == "cpu" else "h200-llama-3-8b")
        cost_model = OnlineCostModel(
            dict(priors.tier_costs),
            priors.prefill,
            block_bytes=kv_cache.bytes_per_block,
            block_tokens=kv_cache.block_size,
        )
        return cls(config, store, kv_cache, namespace, cost_model)

    def after_step(self, report: WorkerReport | None = None) -> None:
        """Hand the worker's report of this step to the scheduler side."""
        self.scheduler.update_from_worker(report or self.worker.take_report())

    def flush(self) -> None:
        """Write out every block freed since the last step, then wait for demotions. Call only
        between steps."""
        meta = self.scheduler.take_pending_saves()
        self.worker.save_now(meta)
        self.store.flush()

    def stats(self) -> dict[str, Any]:
        """Connector counters (``OffloadStats``), the store's per-tier stats and the cost
        model's snapshot. No side effect."""
        out = self.counters.snapshot()
        store = self.store.stats()
        for row in store["tiers"]:
            out["tiers"].setdefault(row["name"], {"hit_blocks": 0})
        out["store"] = store
        out["cost_model"] = self.cost_model.snapshot()
        out["decision_policy"] = self.config.decision
        return out

    def close(self) -> None:
        """Flush, stop the worker, close the store and its tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            self.worker.close()
            self.store.close()
