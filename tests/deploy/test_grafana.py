"""The Grafana side of deploy/: the dashboard's engine panels query only families that
``kvtier serve`` declares (engine.server.metric_families; tests/engine/server checks that
/metrics exposes exactly those), it has the panels the operator needs, and the compose stack
provisions Grafana with the Prometheus datasource and this dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from cachestore.server.admin import METRIC_NAMES
from engine.server.metric_families import sample_names

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MONITORING = DEPLOY / "monitoring"


def _dashboard() -> dict[str, Any]:
    return json.loads((MONITORING / "grafana-dashboard.json").read_text())


def _names(panel: dict[str, Any]) -> set[str]:
    return set(re.findall(r"kvtier_[a-z_]+", " ".join(t["expr"] for t in panel["targets"])))


def test_engine_panels_query_only_declared_engine_metrics() -> None:
    engine = sample_names()
    suffixes = ("_bucket", "_count", "_sum")
    server = set(METRIC_NAMES) | {m + s for m in METRIC_NAMES for s in suffixes}
    assert not engine & server  # one name never means two things on one Prometheus
    panels = [p for p in _dashboard()["panels"] if p["title"].startswith("Engine:")]
    assert len(panels) >= 6
    for panel in panels:
        used = _names(panel)
        assert used and used <= engine, (panel["title"], used - engine)
    for panel in _dashboard()["panels"]:
        assert _names(panel) <= engine | server, panel["title"]


def test_dashboard_has_the_engine_panels_operators_ask_for() -> None:
    used = {t: _names(p) for p in _dashboard()["panels"] for t in [p["title"]]}
    wanted = {  # concept -> a family some engine panel must query
        "TTFT": "kvtier_time_to_first_token_seconds_bucket",
        "hit rate by tier": "kvtier_prompt_tokens_cached_by_tier_total",
        "loaded tokens": "kvtier_kv_loaded_tokens_total",
        "recomputed tokens": "kvtier_kv_recomputed_tokens_total",
        "load time": "kvtier_kv_load_seconds_sum",
        "tier read latency": "kvtier_kv_tier_read_seconds_bucket",
        "write queues": "kvtier_kv_tier_write_queue_blocks",
        "request throughput": "kvtier_request_success_total",
        "decisions": "kvtier_kv_decisions_total",
    }
    engine_used = set().union(*(n for t, n in used.items() if t.startswith("Engine:")))
    assert {c: n for c, n in wanted.items() if n not in engine_used} == {}
    ttft = next(p for p in _dashboard()["panels"] if "time to first token" in p["title"])
    assert {"histogram_quantile(0.5", "histogram_quantile(0.99"} <= {
        t["expr"].split(",")[0] for t in ttft["targets"]
    }
    assert len({p["id"] for p in _dashboard()["panels"]}) == len(_dashboard()["panels"])


def test_compose_provisions_grafana_with_prometheus_and_the_dashboard() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    grafana = compose["services"]["grafana"]
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", grafana["image"])
    assert "/api/health" in " ".join(grafana["healthcheck"]["test"])
    mounts = {}
    for volume in grafana["volumes"]:
        source, target, mode = volume.split(":")
        assert mode == "ro" and (DEPLOY / source).is_file(), volume
        mounts[target] = DEPLOY / source
    provisioning = "/etc/grafana/provisioning/"
    datasources = [m for t, m in mounts.items() if t.startswith(provisioning + "datasources/")]
    providers = [m for t, m in mounts.items() if t.startswith(provisioning + "dashboards/")]
    (source,) = yaml.safe_load(datasources[0].read_text())["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"]
    host, port = re.fullmatch(r"http://([a-z-]+):(\d+)", source["url"]).groups()
    assert host in compose["services"] and compose["services"][host]["image"].startswith("prom/")
    assert f"{port}:{port}" in " ".join(compose["services"][host]["ports"])
    (provider,) = yaml.safe_load(providers[0].read_text())["providers"]
    folder = provider["options"]["path"]
    dashboards = [
        m for t, m in mounts.items() if t.startswith(folder + "/") and t.endswith(".json")
    ]
    assert dashboards == [MONITORING / "grafana-dashboard.json"]
    assert grafana["ports"] == ["127.0.0.1:3000:3000"]  # loopback: anonymous viewers allowed


def test_prometheus_scrapes_the_engine_where_compose_serves_it() -> None:
    prom = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    (job,) = [j for j in prom["scrape_configs"] if j["job_name"] == "kvtier-engine"]
    assert job["metrics_path"] == "/metrics"
    (target,) = [t for sc in job["static_configs"] for t in sc["targets"]]
    host, port = target.split(":")
    command = compose["services"][host]["command"]
    assert command[0] == "serve" and command[command.index("--port") + 1] == port
