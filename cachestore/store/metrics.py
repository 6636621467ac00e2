"""Per-tier counters, transfer-rate estimates and failure backoff for the hierarchical store.

``TierStats`` is what ``HierarchicalStore.stats()`` reports per tier and what the Prometheus
collector exports; ``TierHealth`` decides when a failing tier is skipped (exponential backoff)
and when it is probed again, and ``call_with_backoff`` applies both to one tier call. Both are thread-safe (one lock each). Torch-free; prometheus-client
is imported only when a registry is given.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from cachestore.store.histogram import LatencyHistogram

log = logging.getLogger("cachestore.store")  # the store's logger: these are its tier failures
T = TypeVar("T")
X = TypeVar("X")

COUNTERS = (
    "hits",
    "misses",
    "bytes_read",
    "bytes_written",
    "errors",
    "corrupt",
    "skipped",
    "evictions",
    "demoted",
    "demotions_dropped",
    "dropped_at_bottom",
    "promotions",
    "promotions_dropped",
    "written_through",
    "written_back",
    "write_queue_dropped",
    "write_present",
    "placement_skipped",
    "resave_bypassed",
)


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0  # TierError (or any backend exception) raised by the tier
    corrupt: int = 0  # values that failed to decode (CodecError): counted as misses too
    wrong_key: int = 0  # of those, blocks that carry another key than the one read (misses)
    skipped: int = 0  # calls not made because the tier was backing off
    evictions: int = 0
    demoted: int = 0  # evictions copied out and queued for the tier below (it lacked them)
    demotions_dropped: int = 0  # evictions not demoted (queue full, or no bytes handed over)
    dropped_at_bottom: int = 0  # evictions of the last tier: gone for good
    promotions: int = 0  # blocks queued for promotion into the top tier from this tier
    promotions_dropped: int = 0
    # Write policies (cachestore.store.write_through), counted on the tier written to:
    written_through: int = 0  # blocks copied here by a write-through lane
    written_back: int = 0  # blocks demoted here (evicted above) or flushed here at shutdown
    inflight_hits: int = 0  # reads answered by blocks queued for this tier, not yet written
    write_queue_dropped: int = 0  # blocks not copied: write-through queue full, or shutdown
    write_present: int = 0  # blocks not rewritten: this tier already held them
    placement_skipped: int = 0  # blocks not written here: never worth loading (skip_tiers)
    resave_bypassed: int = 0  # blocks a lower tier held not saved here again (store.resave)
    read_latency_s: float = 0.0  # EWMA of one get_many call
    read_bandwidth_bps: float = 0.0  # EWMA of bytes / second of get_many calls that moved bytes
    write_bandwidth_bps: float = 0.0


class TierStats:
    """Counters of one tier. Thread-safe."""

    def __init__(self, name: str, ewma_alpha: float) -> None:
        self.name = name
        self._alpha = ewma_alpha
        self._c = _Counters()
        self._read_hist = LatencyHistogram()  # one batched read (get_many) each
        self._write_hist = LatencyHistogram()  # one batched write (put_many) each
        self._lock = threading.Lock()

    def _ewma(self, old: float, sample: float) -> float:
        return sample if old == 0.0 else old + self._alpha * (sample - old)

    def add(self, counter: str, n: int = 1) -> None:
        with self._lock:
            setattr(self._c, counter, getattr(self._c, counter) + n)

    def record_read(self, hits: int, misses: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            c = self._c
            c.hits += hits
            c.misses += misses
            c.bytes_read += nbytes
            c.read_latency_s = self._ewma(c.read_latency_s, seconds)
            self._read_hist.observe(seconds)
            if nbytes and seconds > 0:
                c.read_bandwidth_bps = self._ewma(c.read_bandwidth_bps, nbytes / seconds)

    def record_write(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            c = self._c
            c.bytes_written += nbytes
            self._write_hist.observe(seconds)
            if nbytes and seconds > 0:
                c.write_bandwidth_bps = self._ewma(c.write_bandwidth_bps, nbytes / seconds)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "name": self.name,
                **asdict(self._c),
                "read_seconds": self._read_hist.snapshot(),
                "write_seconds": self._write_hist.snapshot(),
            }


class TierHealth:
    """Exponential backoff after failures: skip the tier until ``initial * 2**(n-1)`` seconds
    (capped at ``max_s``) after its n-th consecutive failure; the first call after that is a
    probe, and one success resets it. Thread-safe."""

    def __init__(self, initial_s: float, max_s: float, clock: Callable[[], float]) -> None:
        self._initial_s = initial_s
        self._max_s = max_s
        self._clock = clock
        self._failures = 0
        self._skip_until = 0.0
        self._last_call = clock()  # when a call last reached the tier (or the tier was made)
        self._lock = threading.Lock()

    def available(self) -> bool:
        with self._lock:
            return self._failures == 0 or self._clock() >= self._skip_until

    def record_failure(self) -> None:
        with self._lock:
            self._last_call = self._clock()
            self._failures += 1
            delay = min(self._initial_s * 2 ** (self._failures - 1), self._max_s)
            self._skip_until = self._clock() + delay

    def record_success(self) -> None:
        with self._lock:
            self._last_call = self._clock()
            self._failures = 0

    def idle_s(self) -> float:
        """Seconds since a call last reached the tier (succeeded or failed)."""
        with self._lock:
            return self._clock() - self._last_call

    @property
    def consecutive_failures(self) -> int:
        with self._lock:
            return self._failures


def call_with_backoff(
    target: X, fn: Callable[[X], T], default: T, *, name: str, stats: TierStats, health: TierHealth
) -> T:
    """``fn(target)`` unless ``health`` says back off (then ``default``, counted ``skipped``).
    Any exception (TierError, or a backend bug) is logged, counted in ``errors``, recorded as a
    failure and answered with ``default``: a miss, never a failure of the caller."""
    if not health.available():
        stats.add("skipped")
        return default
    try:
        result = fn(target)
    except Exception as exc:
        log.warning("tier %s failed: %s", name, exc)
        stats.add("errors")
        health.record_failure()
        return default
    health.record_success()
    return result


@dataclass(frozen=True, slots=True)
class _Metric:
    name: str
    help: str
    counter: bool


_EXPORTED = [
    _Metric("hits", "blocks found in this tier", True),
    _Metric("misses", "blocks asked of this tier and not found", True),
    _Metric("bytes_read", "encoded bytes read", True),
    _Metric("bytes_written", "encoded bytes written", True),
    _Metric("errors", "backend failures (degraded to misses or skipped writes)", True),
    _Metric("corrupt", "values that failed to decode", True),
    _Metric("wrong_key", "blocks read under a key other than the one they carry", True),
    _Metric("skipped", "calls skipped while the tier backed off", True),
    _Metric("evictions", "entries evicted", True),
    _Metric("demoted", "evictions copied out and queued for the tier below", True),
    _Metric("demotions_dropped", "evictions not demoted to the next tier", True),
    _Metric("promotions", "blocks promoted from this tier to the top", True),
    _Metric("written_through", "blocks copied to this tier by its write-through queue", True),
    _Metric("written_back", "blocks written to this tier on eviction above or at shutdown", True),
    _Metric(
        "inflight_hits", "reads answered by blocks queued for this tier, not yet written", True
    ),
    _Metric("write_queue_dropped", "blocks dropped from a full write-through queue", True),
    _Metric("write_present", "blocks not rewritten because this tier held them", True),
    _Metric(
        "resave_bypassed", "blocks a lower tier held, not saved here again (evicted unread)", True
    ),
    _Metric("write_queue_depth", "blocks waiting in this tier's write-through queue", False),
    _Metric("read_latency_s", "EWMA latency of one batched read, seconds", False),
    _Metric("read_bandwidth_bps", "EWMA read bandwidth, bytes per second", False),
    _Metric("write_bandwidth_bps", "EWMA write bandwidth, bytes per second", False),
]


def register_prometheus(registry: Any, snapshot: Callable[[], list[dict[str, Any]]]) -> Any:
    """Export ``kvtier_store_*{tier=...}`` from ``snapshot()`` at scrape time; return the
    collector (unregister it with ``registry.unregister``). Raises ImportError without
    prometheus-client."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class _Collector:
        def collect(self) -> Any:
            rows = snapshot()
            for m in _EXPORTED:
                family_cls = CounterMetricFamily if m.counter else GaugeMetricFamily
                family = family_cls(f"kvtier_store_{m.name}", m.help, labels=["tier"])
                for row in rows:
                    family.add_metric([row["name"]], float(row[m.name]))
                yield family

        def describe(self) -> list[Any]:
            return []  # no describe at registration time: collect() then runs only on scrape

    collector = _Collector()
    registry.register(collector)
    return collector
