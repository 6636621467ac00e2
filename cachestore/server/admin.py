"""The cache daemon's HTTP admin port: ``/health``, ``/metrics``, ``/stats``, ``/namespaces``.

Metrics live in their own ``CollectorRegistry`` (never the global one), so several daemons can
run in one process (tests) and nothing else leaks into the scrape. Exported names (the Grafana
dashboard in deploy/ uses exactly these; tests/deploy checks it):

    kvtier_server_requests_total{op,code}        counter
    kvtier_server_request_seconds{op}            histogram
    kvtier_server_keys_total{op,result}          counter   result = hit | miss
    kvtier_server_bytes_total{op,path}           counter   path = tcp | shm
    kvtier_server_put_races_total                counter   put keys left to a concurrent put
                                                           of the same key (not stored by it)
    kvtier_server_handshakes_denied_total        counter   ZMQ connections refused in the
                                                           handshake: token not in --tokens
    kvtier_server_inflight_requests              gauge
    kvtier_server_namespace_bytes{namespace}     gauge
    kvtier_server_namespace_keys{namespace}      gauge
    kvtier_tier_used_bytes{tier}                 gauge     from the store's tier_usage at scrape
    kvtier_tier_capacity_bytes{tier}             gauge
    kvtier_tier_entries{tier}                    gauge

``AdminMetrics.record`` is thread-safe (prometheus-client locks internally). FastAPI, uvicorn and
prometheus-client are imported here only, so the daemon core does not need them.

Access: ``/stats``, ``/namespaces`` and ``/metrics`` name every tenant and its usage. The CLI
binds the port to loopback by default and refuses another address without an admin token;
with a token (``create_app(..., token=...)``) those endpoints need ``Authorization: Bearer
TOKEN`` (401 otherwise). ``/health`` stays open (probes), and says nothing about tenants.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from cachestore.server.daemon import CacheServer, RequestRecord

METRIC_NAMES = (
    "kvtier_server_requests_total",
    "kvtier_server_request_seconds",
    "kvtier_server_keys_total",
    "kvtier_server_bytes_total",
    "kvtier_server_inflight_requests",
    "kvtier_server_namespace_bytes",
    "kvtier_server_namespace_keys",
    "kvtier_tier_used_bytes",
    "kvtier_tier_capacity_bytes",
    "kvtier_tier_entries",
    "kvtier_server_lent_bytes",
    "kvtier_server_leased_bytes",
    "kvtier_server_leased_blocks_total",
    "kvtier_server_put_races_total",
    "kvtier_server_handshakes_denied_total",
)


class AdminMetrics:
    """Prometheus metrics of one daemon. Pass ``record`` as the server's ``on_request``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvtier_server_requests", "Requests served", ["op", "code"], registry=r
        )
        self.seconds = Histogram(
            "kvtier_server_request_seconds",
            "Request service time",
            ["op"],
            registry=r,
            buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
        )
        self.keys = Counter("kvtier_server_keys", "Keys asked for", ["op", "result"], registry=r)
        self.bytes = Counter(
            "kvtier_server_bytes", "Payload bytes moved", ["op", "path"], registry=r
        )
        self.put_races = Counter(
            "kvtier_server_put_races",
            "Put keys left to a concurrent put of the same key",
            registry=r,
        )
        self._server: CacheServer | None = None

    def bind(self, server: CacheServer) -> None:
        """Attach the server whose live state (in-flight, namespaces, tiers) is scraped."""
        self._server = server
        self.registry.register(_LiveCollector(lambda: self._server))

    def record(self, rec: RequestRecord) -> None:
        self.requests.labels(rec.op, rec.code.name).inc()
        self.seconds.labels(rec.op).observe(rec.seconds)
        if rec.op in ("get", "lookup") and rec.num_keys:
            self.keys.labels(rec.op, "hit").inc(rec.num_hits)
            self.keys.labels(rec.op, "miss").inc(rec.num_keys - rec.num_hits)
        if rec.num_raced:
            self.put_races.inc(rec.num_raced)
        moved = rec.bytes_in + rec.bytes_out
        if moved:
            self.bytes.labels(rec.op, rec.path).inc(moved)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _LiveCollector:
    """Gauges read at scrape time, so they are never stale and cost nothing between scrapes."""

    def __init__(self, get_server: Callable[[], CacheServer | None]) -> None:
        self._get_server = get_server

    def describe(self) -> list[Any]:
        return []  # unchecked collector: its series depend on live state

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        server = self._get_server()
        if server is None:
            return
        denied = CounterMetricFamily(
            "kvtier_server_handshakes_denied",
            "ZMQ connections refused in the handshake (token not in --tokens)",
        )
        denied.add_metric([], server.handshakes_denied)
        yield denied
        inflight = GaugeMetricFamily("kvtier_server_inflight_requests", "Requests in flight")
        inflight.add_metric([], server.inflight)
        yield inflight
        lent = GaugeMetricFamily(
            "kvtier_server_lent_bytes", "Host-tier bytes pinned under zero-copy replies in flight"
        )
        lent.add_metric([], server.handler.lent_bytes)
        yield lent
        leases = server.leases
        leased = GaugeMetricFamily(
            "kvtier_server_leased_bytes",
            "Host-tier bytes pinned under same-host in-place reads (leases)",
        )
        leased.add_metric([], leases.budget.held_bytes if leases is not None else 0)
        yield leased
        granted = CounterMetricFamily(
            "kvtier_server_leased_blocks", "Blocks read in place under a lease since start"
        )
        granted.add_metric([], leases.budget.num_granted if leases is not None else 0)
        yield granted
        ns_bytes = GaugeMetricFamily(
            "kvtier_server_namespace_bytes", "Bytes per namespace", labels=["namespace"]
        )
        ns_keys = GaugeMetricFamily(
            "kvtier_server_namespace_keys", "Keys per namespace", labels=["namespace"]
        )
        for name, usage in server.handler.usage.snapshot().items():
            ns_bytes.add_metric([name], usage["bytes"])
            ns_keys.add_metric([name], usage["keys"])
        yield ns_bytes
        yield ns_keys
        used = GaugeMetricFamily("kvtier_tier_used_bytes", "Bytes held per tier", labels=["tier"])
        cap = GaugeMetricFamily("kvtier_tier_capacity_bytes", "Capacity per tier", labels=["tier"])
        entries = GaugeMetricFamily("kvtier_tier_entries", "Entries per tier", labels=["tier"])
        # tier_usage leaves out a failing tier rather than failing the scrape.
        for name, u in server.store.tier_usage().items():
            used.add_metric([name], u.used_bytes)
            if u.capacity_bytes is not None:
                cap.add_metric([name], u.capacity_bytes)
            entries.add_metric([name], u.num_entries)
        yield used
        yield cap
        yield entries


def health_body(store_stats: dict[str, Any], url: str | None, inflight: int) -> dict[str, Any]:
    """The ``/health`` body, as the engine's: each tier ``up``, or ``down`` while its last
    call failed (the store backs it off and its prober pings it again every few seconds, so
    a Redis that refuses connections shows within about 5 s even while idle); ``status`` is
    ``degraded`` (HTTP 200: the daemon serves, a down tier reads as misses) when any is down.
    Pure."""
    tiers = [
        {"name": row["name"], "state": "down" if row.get("consecutive_failures", 0) else "up"}
        for row in store_stats.get("tiers", [])
        if "name" in row
    ]
    degraded = any(t["state"] != "up" for t in tiers)
    return {
        "status": "degraded" if degraded else "ok",
        "tiers": tiers,
        "url": url,
        "inflight": inflight,
    }


def create_app(server: CacheServer, metrics: AdminMetrics, token: str | None = None) -> Any:
    """The FastAPI app. Read-only: no endpoint mutates the store. With ``token``, every
    endpoint but ``/health`` answers 401 unless the request carries it as a bearer token."""
    from fastapi import FastAPI, Request, Response
    from fastapi.responses import JSONResponse

    app = FastAPI(
        title="kvtier cache-server admin", docs_url=None, redoc_url=None, openapi_url=None
    )
    if token is not None:
        expected = f"Bearer {token}".encode()

        @app.middleware("http")
        async def bearer(request: Request, call_next: Callable[[Request], Any]) -> Any:
            given = request.headers.get("authorization", "").encode()
            if request.url.path != "/health" and not hmac.compare_digest(given, expected):
                return JSONResponse(
                    {"error": "admin token required"},
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
            return await call_next(request)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return health_body(server.store.stats(), server.bound_url, server.inflight)

    @app.get("/metrics")
    def prom() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/stats")
    def stats() -> dict[str, Any]:
        usage = {
            name: {
                "used_bytes": u.used_bytes,
                "capacity_bytes": u.capacity_bytes,
                "num_entries": u.num_entries,
            }
            for name, u in server.store.tier_usage().items()
        }
        return {
            "store": server.store.stats(),
            "tier_usage": usage,
            "namespaces": server.handler.usage.snapshot(),
            "inflight": server.inflight,
            "handshakes_denied": server.handshakes_denied,
        }

    @app.get("/namespaces")
    def namespaces() -> dict[str, Any]:
        return server.handler.usage.snapshot()

    return app


class AdminServer:
    """uvicorn on a thread; ``stop`` returns once it has shut down. Loopback by default."""

    def __init__(self, app: Any, host: str, port: int) -> None:
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="kvtier-admin", daemon=True)

    def start(self) -> AdminServer:
        self._thread.start()
        return self

    @property
    def started(self) -> bool:
        return bool(self._server.started)

    def wait_started(self, timeout_s: float = 10.0) -> bool:
        """Block until uvicorn listens (True) or gave up, e.g. on a taken port (False: its
        thread ended, or ``timeout_s`` passed)."""
        deadline = time.monotonic() + timeout_s
        while not self.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
