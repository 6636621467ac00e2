"""deploy/ is valid: YAML parses, compose passes `docker compose config` where that works,
Kubernetes manifests carry the fields their kinds require (kubeconform is not on PyPI/Debian),
tier YAMLs parse with the real tier-config parser, and the Grafana dashboard only queries
metrics the code exports."""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from cachestore.server.admin import METRIC_NAMES, AdminMetrics
from cachestore.server.daemon import CacheServer, RequestRecord, ServerConfig
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from tiers.config import parse_tier_config
from tiers.lmdb import LmdbTier
from tiers.remote.protocol import ErrorCode

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
REQUIRED: dict[str, list[str]] = {  # kind -> dotted paths that must exist
    "Service": ["metadata.name", "spec.selector", "spec.ports"],
    "StatefulSet": ["metadata.name", "spec.serviceName", "spec.selector.matchLabels",
                    "spec.template.metadata.labels", "spec.template.spec.containers",
                    "spec.volumeClaimTemplates"],
    "Deployment": ["metadata.name", "spec.selector.matchLabels", "spec.template.metadata.labels",
                   "spec.template.spec.containers"],
    "ConfigMap": ["metadata.name", "data"],
    "Secret": ["metadata.name"],
    "PersistentVolumeClaim": ["metadata.name", "spec.accessModes", "spec.resources.requests.storage"],
    "Job": ["metadata.name", "spec.template.spec.containers", "spec.template.spec.restartPolicy"],
}


def _get(doc: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(doc, dict) or part not in doc:
            raise KeyError(path)
        doc = doc[part]
    return doc


def _manifests() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_every_yaml_parses() -> None:
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert len(files) >= 8
    for path in files:
        assert list(yaml.safe_load_all(path.read_text())), path


def test_kubernetes_manifests_have_required_fields() -> None:
    docs = _manifests()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "Deployment", "Deployment", "Job", "PersistentVolumeClaim", "Secret",
                     "Secret", "Secret", "Service", "Service", "Service", "Service", "StatefulSet",
                     "StatefulSet"]
    for doc in docs:
        assert doc["apiVersion"] in ("v1", "apps/v1", "batch/v1"), doc["kind"]
        for path in REQUIRED[doc["kind"]]:
            _get(doc, path)
        if doc["kind"] in ("StatefulSet", "Deployment"):
            spec = doc["spec"]
            labels = spec["template"]["metadata"]["labels"]
            assert spec["selector"]["matchLabels"].items() <= labels.items()
            for c in spec["template"]["spec"]["containers"]:
                image = c["image"]
                assert ":" in image and not image.endswith(":latest"), image  # pinned
            for c in spec["template"]["spec"]["containers"]:
                assert c["name"] and c["image"]
                mounts = {m["name"] for m in c.get("volumeMounts", [])}
                volumes = {v["name"] for v in spec["template"]["spec"].get("volumes", [])}
                claims = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
                assert mounts <= volumes | claims, (doc["metadata"]["name"], mounts)
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    engine = by_name[("Deployment", "kvtier-engine")]["spec"]["template"]["spec"]["containers"][0]
    assert engine["resources"]["requests"]["nvidia.com/gpu"] == 1
    daemon = by_name[("StatefulSet", "kvtier-cache-server")]
    assert daemon["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    # Services select pods that exist.
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in docs
                  if d["kind"] in ("StatefulSet", "Deployment")]
    for svc in (d for d in docs if d["kind"] == "Service"):
        assert any(svc["spec"]["selector"].items() <= lab.items() for lab in pod_labels)


def _refs(node: Any, found: dict[str, set[str]]) -> None:
    """Names of the Secrets, ConfigMaps and claims a manifest refers to (anywhere in it)."""
    if isinstance(node, dict):
        if "claimName" in node:
            found["PersistentVolumeClaim"].add(node["claimName"])
        if "secretName" in node:
            found["Secret"].add(node["secretName"])
        for key, kind in (("secretRef", "Secret"), ("secretKeyRef", "Secret"),
                          ("configMapRef", "ConfigMap"), ("configMap", "ConfigMap")):
            if isinstance(node.get(key), dict) and "name" in node[key]:
                found[kind].add(node[key]["name"])
        for value in node.values():
            _refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _refs(value, found)


def test_kubernetes_manifests_define_what_they_reference() -> None:
    """Every claim, Secret, ConfigMap and Service host a manifest names is defined; tokens live
    in Secrets, never in the ConfigMap."""
    docs = _manifests()
    defined = {(d["kind"], d["metadata"]["name"]) for d in docs}
    found: dict[str, set[str]] = {"PersistentVolumeClaim": set(), "Secret": set(), "ConfigMap": set()}
    for doc in docs:
        _refs(doc, found)
    assert found["PersistentVolumeClaim"] and found["Secret"]
    for kind, names in found.items():
        for name in names:
            assert (kind, name) in defined, (kind, name)
    configmap = next(d for d in docs if d["kind"] == "ConfigMap")
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    for text in configmap["data"].values():
        for tier in parse_tier_config(yaml.safe_load(text)).tiers:
            assert getattr(tier, "token", None) is None, tier  # a token_file from a Secret
            url = getattr(tier, "url", None) or getattr(tier, "endpoint_url", None)
            if url:
                host = re.sub(r"^[a-z]+://", "", url).split(":")[0].split("/")[0]
                assert host in services, url


def _cli_flags_ok(argv: list[str]) -> None:
    """``kvtier ARGV`` parses with the real CLI parser (every flag exists, values well-formed)."""
    from engine.cli import build_parser

    build_parser(argv).parse_args(argv)


def test_every_flag_deploy_passes_exists_in_the_cli() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    commands = [compose["services"][s]["command"] for s in ("cache-server", "engine")]
    for doc in _manifests():
        if doc["kind"] in ("StatefulSet", "Deployment"):
            commands += [c["args"] for c in doc["spec"]["template"]["spec"]["containers"]
                         if c["image"].startswith("kvtier:")]
    for path in sorted((DEPLOY / "systemd").glob("*.service")):
        unit = configparser.ConfigParser(interpolation=None)
        unit.read_string(path.read_text())
        commands.append(unit["Service"]["ExecStart"].split()[1:])
    assert len(commands) == 6
    for argv in commands:
        _cli_flags_ok([str(a) for a in argv])


def test_compose_pins_images_and_orders_start_by_health() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    for name, svc in services.items():
        image = svc["image"]
        assert ":" in image and not image.endswith(":latest"), (name, image)
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert cond["condition"] in ("service_healthy", "service_completed_successfully"), name
            wanted = "service_completed_successfully" if dep == "minio-init" else "service_healthy"
            assert cond["condition"] == wanted and ("healthcheck" in services[dep]) == (dep != "minio-init")
    for name in ("redis", "minio", "cache-server", "engine"):
        assert "healthcheck" in services[name], name
    assert "mc mb" in " ".join(services["minio-init"]["command"])  # the tiers' bucket exists
    # The engine reserves a GPU, so its image is the CUDA build; the daemon's is the CPU one.
    engine = services["engine"]
    assert engine["image"] == "kvtier:cuda" and "/cu" in engine["build"]["args"]["TORCH_INDEX"]
    assert services["cache-server"]["image"] == "kvtier:cpu"


def test_tier_yamls_parse_with_the_real_parser() -> None:
    configmap = next(d for d in _manifests() if d["kind"] == "ConfigMap")
    texts = [(DEPLOY / "tiers.yaml").read_text(), (DEPLOY / "engine-tiers.yaml").read_text(),
             configmap["data"]["tiers.yaml"], configmap["data"]["engine-tiers.yaml"]]
    kinds = [[t.kind for t in parse_tier_config(yaml.safe_load(x)).tiers] for x in texts]
    assert kinds == [["redis", "s3"], ["host", "remote"], ["redis", "s3"], ["host", "remote"]]


def _compose_command() -> list[str] | None:
    """``docker compose`` (v2 plugin) where it works, else Debian's ``docker-compose`` (v1)."""
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy is not None else None


def test_compose_services_and_config() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert set(compose["services"]) >= {"engine", "cache-server", "redis", "minio"}
    daemon = compose["services"]["cache-server"]["command"]
    assert daemon[0] == "cache-server" and "--tokens" in daemon  # non-loopback needs tokens
    command = _compose_command()
    if command is None:
        pytest.skip("neither `docker compose` nor docker-compose is available")
    result = subprocess.run([*command, "-f", str(DEPLOY / "docker-compose.yml"), "config",
                             "--quiet"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_systemd_units() -> None:
    for name in ("kvtier-cache-server.service", "kvtier-engine.service"):
        unit = configparser.ConfigParser(strict=True, interpolation=None)
        unit.read_string((DEPLOY / "systemd" / name).read_text())
        assert {"Unit", "Service", "Install"} <= set(unit.sections())
        assert unit["Service"]["ExecStart"].startswith("/opt/kvtier/.venv/bin/kvtier ")
        # SIGTERM to the main process only; the stop timeout leaves room for the KV drain
        # (2 x drain_timeout_s: 10 s for an engine, 20 s for the daemon, plus its requests).
        assert unit["Service"]["KillSignal"] == "SIGTERM"
        assert unit["Service"]["KillMode"] == "mixed"
        assert int(unit["Service"]["TimeoutStopSec"]) >= 40
    daemon = configparser.ConfigParser(interpolation=None)
    daemon.read_string((DEPLOY / "systemd" / "kvtier-cache-server.service").read_text())
    assert "--host 127.0.0.1" in daemon["Service"]["ExecStart"]


def test_grafana_queries_only_exported_metrics(tmp_path: Path) -> None:
    from engine.server.metric_families import sample_names  # engine panels: test_grafana.py

    dashboard = json.loads((DEPLOY / "monitoring" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = set(re.findall(r"kvtier_[a-z_]+", " ".join(exprs))) - sample_names()
    suffixes = ("_bucket", "_count", "_sum")
    exported = set(METRIC_NAMES) | {m + s for m in METRIC_NAMES for s in suffixes}
    assert used and used <= exported, used - exported
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    # ...and a live daemon's /metrics exposition really carries every one of them.
    store = HierarchicalStore([LmdbTier(tmp_path, 1 << 20)], StoreConfig())
    server = CacheServer(ServerConfig(url="tcp://127.0.0.1:0"), store)
    metrics = AdminMetrics()
    metrics.bind(server)
    server.handler.usage.add("default", [("default/ns/01", 10)])
    metrics.record(RequestRecord("get", "default", ErrorCode.OK, 2, 1, 0, 10, "tcp", 0.001))
    text = metrics.exposition().decode()
    store.close()
    for name in used:
        assert re.search(rf"^{name}[{{ ]", text, re.M), name


def test_prometheus_scrapes_the_admin_port() -> None:
    prom = yaml.safe_load((DEPLOY / "monitoring" / "prometheus.yml").read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]]
    assert "cache-server:5556" in targets
