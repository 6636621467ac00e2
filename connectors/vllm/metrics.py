"""kvtier's counters in vLLM's metrics pipeline (imports vLLM and prometheus_client).

``KvtierStats`` (a ``KVConnectorStats``) carries ``stats.Counters`` increments from the workers
and the scheduler to vLLM's front end, summed per key when aggregated; vLLM's periodic log
prints them ("KV Transfer metrics: ..."). ``KvtierPromMetrics`` exports each counter of
``stats.COUNTERS`` as the Prometheus counter ``vllm:kvtier_<name>`` (``_total`` in the
exposition), labelled like vLLM's own metrics (model, engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from connectors.vllm.stats import COUNTERS


@dataclass
class KvtierStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvtierStats:
        out = dict(self.data)
        for name, value in other.data.items():
            out[name] = out.get(name, 0) + value
        return KvtierStats(data=out)

    def reduce(self) -> dict[str, int | float]:
        return {name: round(value, 6) for name, value in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvtierPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            metric = self._counter_cls(
                name=f"vllm:kvtier_{name}", documentation=f"kvtier: {doc}", labelnames=labelnames
            )
            self.counters[name] = create_metric_per_engine(metric, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self.counters.get(name)
            if per_engine is not None and value > 0:
                per_engine[engine_idx].inc(value)
