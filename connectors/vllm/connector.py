"""``KvtierConnector``: kvtier's tiers, keys, cost model and cache server as a vLLM KV connector.

Loaded by vLLM from ``--kv-transfer-config '{"kv_connector": "KvtierConnector",
"kv_connector_module_path": "connectors.vllm", "kv_role": "kv_both",
"kv_connector_extra_config": {"kvtier_config": "tiers.yaml"}}'`` (docs/vllm.md). vLLM builds
it twice; each instance holds one side:

- scheduler role (engine-core process): ``connectors.vllm.scheduler.VllmScheduler`` over the
  lookup view of the tiers below host (``connectors.vllm.lookup``) and an ``OnlineCostModel``
  (priors by platform or ``cost_profile``; then the worker's measured loads and prefills);
- worker role (each worker process): ``connectors.vllm.worker.VllmWorker`` with the whole
  ``HierarchicalStore`` (host tier sized to the encoded block, the stack's write policies),
  built in ``register_kv_caches`` once the KV tensors are known.

Loads are synchronous (before the forward of the step that admits the request); saves copy
the step's full blocks out after the forward and write them in the background. A load that
fails is reported through ``get_block_ids_with_load_errors``: with vLLM's
``kv_load_failure_policy: "recompute"`` the request recomputes from there (with ``"fail"``,
vLLM's default, it fails; a warning says so at start). This module and ``metrics`` are the only
ones of kvtier that import vLLM (tests/test_layers.py).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from cachestore.codec import PAYLOAD_ALIGN, encoded_size
from cachestore.cost.online import CostPriors, OnlineCostModel, default_priors
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from cachestore.store.types import write_policies
from connectors.vllm.config import VllmConnectorConfig, parse_connector_config
from connectors.vllm.keys import layout_name, make_namespace
from connectors.vllm.lookup import build_lookup_store
from connectors.vllm.metadata import StepPlan, WorkerFeedback
from connectors.vllm.metrics import KvtierPromMetrics, KvtierStats
from connectors.vllm.scheduler import ScheduledRequest, VllmScheduler
from connectors.vllm.stats import Counters
from connectors.vllm.worker import KvLayout, VllmWorker
from tiers import build_tiers

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    feedback: WorkerFeedback = field(default_factory=WorkerFeedback)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvtierWorkerMetadata:
        if not isinstance(other, KvtierWorkerMetadata):
            return self
        return KvtierWorkerMetadata(self.feedback.merge(other.feedback))


@dataclass(frozen=True)
class _Spec:
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    block_bytes: int  # one block across all layers


class KvtierConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config: VllmConnectorConfig = parse_connector_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        self.counters = Counters()
        self.spec = _spec(kv_cache_config, vllm_config.cache_config.block_size)
        self.layout = layout_name(
            self.spec.dtype,
            self.spec.num_layers,
            self.spec.num_kv_heads,
            self.spec.head_size,
            self.spec.block_size,
        )
        fingerprint = _fingerprint(vllm_config.model_config)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.scheduler_side: VllmScheduler | None = None
        self.worker_side: VllmWorker | None = None
        self._failed: set[int] = set()
        self._t_bound = 0.0
        self._load_s = 0.0
        if role == KVConnectorRole.SCHEDULER:
            ns = make_namespace(fingerprint, self.layout, self.spec.block_size, 0, tp_size)
            store = build_lookup_store(self.config.offload.tiers, ns.key_prefix())
            self.scheduler_side = VllmScheduler(
                store, ns, self._cost_model(), self.config.decision, self.counters
            )
            if getattr(self._kv_transfer_config, "kv_load_failure_policy", "") == "fail":
                log.warning(
                    "kvtier: kv_load_failure_policy is 'fail': a block that cannot be "
                    "loaded fails its request; set it to 'recompute'"
                )
            log.info(
                "kvtier connector (scheduler): namespace %s (%s), decision %s",
                ns.key_prefix(),
                ns.describe(),
                self.config.decision,
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.namespace = make_namespace(
                fingerprint,
                self.layout,
                self.spec.block_size,
                get_tensor_model_parallel_rank(),
                tp_size,
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    def _cost_model(self) -> OnlineCostModel:
        from vllm.platforms import current_platform

        kind = self.config.cost_profile or (
            "cpu" if current_platform.is_cpu() else "h200-llama-3-8b"
        )
        base = default_priors(kind)
        return OnlineCostModel.from_priors(
            CostPriors(
                kind,
                dict(base.tier_costs),
                base.prefill,
                self.spec.block_bytes,
                self.spec.block_size,
            )
        )

    # ==== worker side =====================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = KvLayout.from_caches(kv_caches, self._kv_cache_config.num_blocks)
        if layout.block_bytes != self.spec.block_bytes:
            raise ValueError(
                f"kvtier: KV tensors hold {layout.block_bytes} B a block, the KV "
                f"spec says {self.spec.block_bytes}"
            )
        prefix = self.namespace.key_prefix()
        meta = layout.block_meta(prefix, self.layout)
        slot = -(-encoded_size(meta, keyed=True) // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
        stack = self.config.offload.tiers
        store = HierarchicalStore(
            build_tiers(stack, host_slot_bytes=slot),
            StoreConfig(
                namespace=prefix,
                write_policies=write_policies(stack),
                probe_interval_s=self.config.offload.health_probe_s,
            ),
        )
        self.worker_side = VllmWorker(
            store,
            layout,
            meta,
            self.counters,
            self.spec.block_size,
            drain_timeout_s=self.config.offload.drain_timeout_s,
            stats_file=self.config.stats_file,
            stats_interval_s=self.config.stats_interval_s,
        )
        log.info(
            "kvtier connector (worker): %d layers, block %s, namespace %s, tiers %s",
            len(layout.views),
            layout.block_shape,
            prefix,
            [t.name for t in store.tiers],
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._t_bound = time.perf_counter()
        self._load_s = 0.0

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KvtierConnectorMetadata) else StepPlan()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        plan = self._plan()
        if plan.loads and self.worker_side is not None:
            t0 = time.perf_counter()
            self._failed |= self.worker_side.load(plan.loads)
            self._load_s += time.perf_counter() - t0

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole blocks are saved after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        worker = self.worker_side
        if worker is None or not self.has_connector_metadata():
            return
        plan = self._plan()
        if plan.prefill_sample is not None and not plan.loads:
            new, context = plan.prefill_sample
            worker.record_prefill(new, context, time.perf_counter() - self._t_bound)
        worker.save(plan.saves)
        worker.maybe_write_stats()

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def get_kv_connector_stats(self) -> KvtierStats | None:
        data = self.counters.take()
        return KvtierStats(data=data) if data else None

    def build_connector_worker_meta(self) -> KvtierWorkerMetadata | None:
        fb = self.worker_side.take_feedback() if self.worker_side is not None else None
        return KvtierWorkerMetadata(fb) if fb is not None else None

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()
        if self.scheduler_side is not None:
            self.scheduler_side.store.close()

    # ==== scheduler side ==================================================================

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler_side is not None
        return self.scheduler_side.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvtierConnectorMetadata:
        assert self.scheduler_side is not None
        so = scheduler_output
        state = getattr(so, "kv_connector_block_state", None)

        def block_ids(req_id: str, fallback: Any) -> list[int]:
            ids = state.get_block_ids(req_id) if state is not None else None
            if ids is None and self._kv_cache_manager is not None:
                ids = self._kv_cache_manager.get_block_ids(req_id)
            return list((ids or fallback or ([],))[0])

        scheduled = [
            ScheduledRequest(
                r.req_id,
                r.num_computed_tokens,
                so.num_scheduled_tokens.get(r.req_id, 0),
                block_ids(r.req_id, r.block_ids),
            )
            for r in so.scheduled_new_reqs
        ]
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            scheduled.append(
                ScheduledRequest(
                    req_id,
                    cached.num_computed_tokens[i],
                    so.num_scheduled_tokens.get(req_id, 0),
                    block_ids(req_id, None),
                )
            )
        plan = self.scheduler_side.build_step(scheduled, sorted(so.finished_req_ids))
        return KvtierConnectorMetadata(plan)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KvtierWorkerMetadata) and self.scheduler_side is not None:
            self.scheduler_side.feedback(meta.feedback)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler_side is not None:
            self.scheduler_side.forget(request.request_id)
        return False, None

    # ==== metrics ========================================================================

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierStats:
        return KvtierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _spec(kv_cache_config: Any, block_size: int) -> _Spec:
    """The attention KV spec of the one KV cache group. Raises ValueError otherwise."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise ValueError(
            f"kvtier: {len(groups)} KV cache groups; the connector supports models "
            "with one (full attention everywhere)"
        )
    spec = groups[0].kv_cache_spec
    num_layers = len(groups[0].layer_names)
    for name in ("num_kv_heads", "head_size", "dtype", "page_size_bytes"):
        if not hasattr(spec, name):
            raise ValueError(f"kvtier: KV spec {type(spec).__name__} is not an attention spec")
    return _Spec(
        num_layers,
        spec.num_kv_heads,
        spec.head_size,
        str(spec.dtype),
        getattr(spec, "block_size", block_size),
        spec.page_size_bytes * num_layers,
    )


def _fingerprint(model_config: Any) -> str:
    """kvtier's engine fingerprint for a local model directory; else name, revision, dtype."""
    model, dtype = str(model_config.model), model_config.dtype
    if os.path.isfile(os.path.join(model, "config.json")):
        from engine.models.loader import model_fingerprint

        return model_fingerprint(model, dtype)
    return f"hf:{model}@{getattr(model_config, 'revision', None) or 'main'}:{dtype}"
