"""Prometheus metrics for the server, on a dedicated ``CollectorRegistry`` (one per app, so
tests and two apps in one process stay apart).

The families are declared once in ``engine.server.metric_families``. Request counts and
latency histograms (``REQUEST_FAMILIES``) are recorded here as requests flow; everything else
(``SNAPSHOT_FAMILIES``: token and prefix-cache counters, queue gauges, the KV offload
connector's counters and per-tier rows) is read from the engine's ``stats()`` snapshot at
scrape time by ``stats_export`` (the engine keeps them as monotonic totals, so they are never
double counted and cost nothing between scrapes). The set of families is the same with and
without ``--kv-offload``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from engine.outputs import RequestOutput
from engine.server.metric_families import BY_NAME, VLLM_NAMES
from engine.server.return_log import ReturnLog
from engine.server.stats_export import snapshot_families
from engine.ttft import ALL_PHASES, FIRST_TEXT_PHASE, RETURN_PHASE

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip

# TTFT phases run from ~10 us (hashing a short prompt) to seconds (a queue under load).
_PHASE_BUCKETS_S = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02,
    0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip

_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")


class _EngineStatsCollector(Collector):
    """Turns an engine stats snapshot into the snapshot families at scrape time."""

    def __init__(self, read_stats: Callable[[], Mapping[str, Any]], model: str) -> None:
        self._read_stats = read_stats
        self._model = model

    def collect(self) -> Iterator[Metric]:
        yield from snapshot_families(self._read_stats(), self._model)


def _counter(name: str, registry: CollectorRegistry) -> Counter:
    f = BY_NAME[name]
    return Counter(f.name, f.help, ["model_name", *f.labels], unit=f.unit, registry=registry)


def _histogram(name: str, registry: CollectorRegistry, buckets: tuple[float, ...]) -> Histogram:
    f = BY_NAME[name]
    return Histogram(
        f.name, f.help, ["model_name", *f.labels], unit=f.unit, buckets=buckets, registry=registry
    )


class ServerMetrics:
    """All server metrics. Thread-safe (prometheus-client metrics are)."""

    def __init__(
        self,
        read_stats: Callable[[], Mapping[str, Any]],
        model_name: str,
        *,
        vllm_names: bool = False,
    ) -> None:
        """``vllm_names``: also export the families of ``VLLM_NAMES`` under vLLM's names."""
        self._vllm_names = vllm_names
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStatsCollector(read_stats, model_name))
        m = model_name
        self.requests = _counter("kvtier_requests_total", r)
        self.success = _counter("kvtier_request_success_total", r)
        for reason in FINISH_REASONS:  # every finish reason exported from the start (0)
            self.success.labels(m, reason)

        def latency(name: str) -> Any:
            return _histogram(name, r, _LATENCY_BUCKETS_S).labels(m)

        self.ttft = latency("kvtier_time_to_first_token_seconds")
        self.inter_token = latency("kvtier_inter_token_latency_seconds")
        self.e2e = latency("kvtier_e2e_request_latency_seconds")
        self.queue_time = latency("kvtier_request_queue_time_seconds")
        self.prefill_time = latency("kvtier_request_prefill_time_seconds")
        self.inference_time = latency("kvtier_request_inference_time_seconds")
        self.decode_time = latency("kvtier_request_decode_time_seconds")
        self.time_per_output_token = latency("kvtier_request_time_per_output_token_seconds")
        phases = _histogram("kvtier_request_ttft_phase_seconds", r, _PHASE_BUCKETS_S)
        self.ttft_phases = {phase: phases.labels(m, phase) for phase in ALL_PHASES}
        self.prompt_tokens = _histogram("kvtier_request_prompt_tokens", r, _TOKEN_BUCKETS).labels(m)
        self.generation_tokens = _histogram(
            "kvtier_request_generation_tokens", r, _TOKEN_BUCKETS
        ).labels(m)
        self._model_name = m

    def record_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(self._model_name, endpoint, str(status)).inc()

    def record_finished(self, output: RequestOutput) -> None:
        """A request's last output: its finish reason and token counts."""
        self.success.labels(self._model_name, output.finish_reason or "abort").inc()
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        self.generation_tokens.observe(len(output.token_ids))

    def exposition(self) -> bytes:
        """The text exposition format of every metric in this registry, without the
        ``*_created`` timestamps (as vLLM: in the text format they would be extra gauge
        families that no dashboard uses); with ``vllm_names``, followed by the vLLM-named
        copies."""
        return generate_latest(_Exposition(self.registry, self._vllm_names))


class _Exposition(Collector):
    """What ``/metrics`` shows of a registry: its families without their ``_created`` samples;
    with ``vllm_names``, then the copies of ``VLLM_NAMES``'s families under vLLM's names."""

    def __init__(self, registry: CollectorRegistry, vllm_names: bool = False) -> None:
        self._registry = registry
        self._vllm_names = vllm_names

    def collect(self) -> Iterator[Metric]:
        aliases = []
        for metric in self._registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric
            theirs = VLLM_NAMES.get(_exposed_name(metric)) if self._vllm_names else None
            if theirs is not None:
                aliases.append(_renamed(metric, theirs.removesuffix("_total")))
        yield from aliases


def _exposed_name(metric: Metric) -> str:
    """A family's name as declared (prometheus-client drops a counter's ``_total``)."""
    return metric.name + "_total" if metric.type == "counter" else metric.name


def _renamed(metric: Metric, name: str) -> Metric:
    """A copy of ``metric`` named ``name`` (its samples' suffixes kept). No unit: vLLM's
    names carry none of ours (``kv_cache_usage_perc`` is a ratio)."""
    copy = Metric(name, metric.documentation, metric.type)
    copy.samples = [s._replace(name=name + s.name[len(metric.name) :]) for s in metric.samples]
    return copy


class RequestTimer:
    """Per-request latency bookkeeping; feed it each output's arrival. Not thread-safe (one
    request is consumed by one coroutine)."""

    __slots__ = (
        "_metrics",
        "_arrival_s",
        "_last_token_s",
        "_first_token_s",
        "_num_tokens",
        "_scheduled_s",
        "_core_last_token_s",
        "_breakdown_done",
        "_text_done",
        "_return_s",
        "_req_id",
        "_log",
    )

    def __init__(
        self,
        metrics: ServerMetrics,
        arrival_s: float,
        req_id: str = "",
        log: ReturnLog | None = None,
    ) -> None:
        """``log``: where the request's ``return`` and ``first_text`` go, as ``req_id``."""
        self._metrics = metrics
        self._arrival_s = arrival_s
        self._last_token_s: float | None = None
        self._first_token_s: float | None = None
        self._num_tokens = 0
        self._scheduled_s: float | None = None  # the core's stamps (RequestMetrics)
        self._core_last_token_s: float | None = None
        self._breakdown_done = False
        self._text_done = False
        self._return_s = 0.0
        self._req_id = req_id
        self._log = log

    def on_output(self, output: RequestOutput, now_s: float) -> None:
        """Records the TTFT phases once, from the output that carries the first token (the
        return phase, the core's first-token time to ``now_s``, is measured here), the first
        output with text (``first_text``; the finishing one if none has any), and the finish
        reason and token counts from the last output."""
        if output.finished:
            self._metrics.record_finished(output)
        m = output.metrics
        if m is None or m.first_token_time is None:
            return
        self._core_last_token_s = m.last_token_time
        since_first = max(0.0, now_s - m.first_token_time)
        if not self._breakdown_done:
            self._breakdown_done = True
            if m.scheduled_time is not None:  # vLLM's queue and prefill times, core stamps
                self._scheduled_s = m.scheduled_time
                if m.queued_time is not None:
                    self._metrics.queue_time.observe(max(0.0, m.scheduled_time - m.queued_time))
                self._metrics.prefill_time.observe(max(0.0, m.first_token_time - m.scheduled_time))
            phases = self._metrics.ttft_phases
            for phase, seconds in (m.ttft_breakdown or {}).items():
                histogram = phases.get(phase)
                if histogram is not None:
                    histogram.observe(seconds)
            phases[RETURN_PHASE].observe(since_first)
            self._return_s = since_first
        if not self._text_done and (output.new_text or output.finished):
            self._text_done = True
            self._metrics.ttft_phases[FIRST_TEXT_PHASE].observe(since_first)
            if self._log is not None:
                self._log.write(self._req_id, self._return_s, since_first)

    def on_tokens(self, num_new_tokens: int, now_s: float) -> None:
        if num_new_tokens <= 0:
            return
        self._num_tokens += num_new_tokens
        if self._last_token_s is None:
            self._first_token_s = now_s
            self._metrics.ttft.observe(now_s - self._arrival_s)
        else:
            # Tokens that arrive together (one output carrying several) share the interval.
            gap = (now_s - self._last_token_s) / num_new_tokens
            for _ in range(num_new_tokens):
                self._metrics.inter_token.observe(gap)
        self._last_token_s = now_s

    def on_finished(self, now_s: float) -> None:
        """The request's end: its e2e latency; with two tokens or more, its decode time (first
        token to last) and that over the tokens after the first (vLLM's per-request TPOT); its
        inference time (the core's stamps: when it could first compute to its last token)."""
        self._metrics.e2e.observe(now_s - self._arrival_s)
        if self._scheduled_s is not None and self._core_last_token_s is not None:
            self._metrics.inference_time.observe(
                max(0.0, self._core_last_token_s - self._scheduled_s)
            )
        first, last = self._first_token_s, self._last_token_s
        if self._num_tokens >= 2 and first is not None and last is not None:
            self._metrics.decode_time.observe(last - first)
            self._metrics.time_per_output_token.observe((last - first) / (self._num_tokens - 1))
