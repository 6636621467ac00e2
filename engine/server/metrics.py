"""Prometheus metrics for the server, on a dedicated ``CollectorRegistry``.

Request counts and latency histograms are recorded by the API as requests flow; token and
prefix-cache counters and queue gauges are read from the engine's ``stats()`` snapshot at
scrape time (the engine already keeps them as monotonic totals), so they are never double
counted and cost nothing between scrapes. A registry per app keeps tests and two apps in one
process apart.

Every other numeric value of the snapshot, nested ones included (the KV offload counters and
per-tier rows), is exported generically by ``stats_export``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.outputs import RequestOutput
from engine.server.stats_export import stats_families
from engine.ttft import ALL_PHASES, RETURN_PHASE

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (engine stats key, metric name without _total, help). Names match engine.stats() keys.
_ENGINE_COUNTERS = (
    ("prompt_tokens_total", "kvtier_prompt_tokens", "Prompt tokens processed"),
    ("generation_tokens_total", "kvtier_generation_tokens", "Tokens generated"),
    (
        "prefix_cache_hit_tokens_total",
        "kvtier_prefix_cache_hit_tokens",
        "Prompt tokens served from the prefix cache",
    ),
    (
        "prefix_cache_queried_tokens_total",
        "kvtier_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache",
    ),
    ("num_preemptions_total", "kvtier_num_preemptions", "Requests preempted for lack of blocks"),
)
_ENGINE_GAUGES = (
    ("num_requests_running", "kvtier_num_requests_running", "Requests being scheduled"),
    ("num_requests_waiting", "kvtier_num_requests_waiting", "Requests waiting to be scheduled"),
    ("gpu_blocks_total", "kvtier_gpu_blocks_total", "KV blocks in the GPU pool"),
    ("gpu_blocks_free", "kvtier_gpu_blocks_free", "KV blocks free or cached-evictable"),
)

_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


# TTFT phases run from ~10 us (hashing a short prompt) to seconds (a queue under load).
_PHASE_BUCKETS_S = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02,
    0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


def phase_metric_name(phase: str) -> str:
    """The histogram of one TTFT phase (engine/ttft.py): ``kvtier_request_ttft_<phase>_seconds``."""
    return f"kvtier_request_ttft_{phase}_seconds"


_KNOWN_KEYS = frozenset(key for key, _, _ in (*_ENGINE_COUNTERS, *_ENGINE_GAUGES))
# Names (without _total) the server registers itself; generic stats must not shadow them.
_SERVER_NAMES = frozenset(
    (
        "kvtier_requests",
        "kvtier_time_to_first_token_seconds",
        "kvtier_inter_token_latency_seconds",
        "kvtier_e2e_request_latency_seconds",
        *(phase_metric_name(p) for p in ALL_PHASES),
        *(name.removesuffix("_total") for _, name, _ in (*_ENGINE_COUNTERS, *_ENGINE_GAUGES)),
    )
)


class _EngineStatsCollector(Collector):
    """Turns an engine stats snapshot into counter and gauge families at scrape time."""

    def __init__(self, read_stats: Callable[[], Mapping[str, Any]], model: str) -> None:
        self._read_stats = read_stats
        self._model = model

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats()
        for key, name, doc in _ENGINE_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model], float(stats.get(key, 0)))
            yield family
        for key, name, doc in _ENGINE_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model], float(stats.get(key, 0)))
            yield family
        yield from stats_families(stats, self._model, skip_keys=_KNOWN_KEYS, reserved=_SERVER_NAMES)


class ServerMetrics:
    """All server metrics. Thread-safe (prometheus-client metrics are)."""

    def __init__(self, read_stats: Callable[[], Mapping[str, Any]], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStatsCollector(read_stats, model_name))
        self.requests = Counter(
            "kvtier_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvtier_time_to_first_token_seconds",
            "Time from request arrival to its first generated token",
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "kvtier_inter_token_latency_seconds",
            "Time between consecutive generated tokens of one request",
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "kvtier_e2e_request_latency_seconds",
            "Time from request arrival to its last token",
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )

        self.ttft_phases = {
            phase: Histogram(
                phase_metric_name(phase),
                f"Per-request TTFT phase {phase!r} (engine/ttft.py)",
                buckets=_PHASE_BUCKETS_S,
                registry=self.registry,
            )
            for phase in ALL_PHASES
        }

    def record_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def exposition(self) -> bytes:
        """The text exposition format of every metric in this registry."""
        return generate_latest(self.registry)


class RequestTimer:
    """Per-request latency bookkeeping; feed it each output's arrival. Not thread-safe (one
    request is consumed by one coroutine)."""

    __slots__ = ("_metrics", "_arrival_s", "_last_token_s", "_breakdown_done")

    def __init__(self, metrics: ServerMetrics, arrival_s: float) -> None:
        self._metrics = metrics
        self._arrival_s = arrival_s
        self._last_token_s: float | None = None
        self._breakdown_done = False

    def on_output(self, output: RequestOutput, now_s: float) -> None:
        """Records the TTFT phases once, from the output that carries the first token; the
        return phase (the core's first-token time to ``now_s``) is measured here."""
        m = output.metrics
        if self._breakdown_done or m is None or m.first_token_time is None:
            return
        self._breakdown_done = True
        phases = self._metrics.ttft_phases
        for phase, seconds in (m.ttft_breakdown or {}).items():
            histogram = phases.get(phase)
            if histogram is not None:
                histogram.observe(seconds)
        phases[RETURN_PHASE].observe(max(0.0, now_s - m.first_token_time))

    def on_tokens(self, num_new_tokens: int, now_s: float) -> None:
        if num_new_tokens <= 0:
            return
        if self._last_token_s is None:
            self._metrics.ttft.observe(now_s - self._arrival_s)
        else:
            # Tokens that arrive together (one output carrying several) share the interval.
            gap = (now_s - self._last_token_s) / num_new_tokens
            for _ in range(num_new_tokens):
                self._metrics.inter_token.observe(gap)
        self._last_token_s = now_s

    def on_finished(self, now_s: float) -> None:
        self._metrics.e2e.observe(now_s - self._arrival_s)
