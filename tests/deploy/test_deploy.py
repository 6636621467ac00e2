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
    "StatefulSet": [
        "metadata.name",
        "spec.serviceName",
        "spec.selector.matchLabels",
        "spec.template.metadata.labels",
        "spec.template.spec.containers",
        "spec.volumeClaimTemplates",
    ],
    "Deployment": [
        "metadata.name",
        "spec.selector.matchLabels",
        "spec.template.metadata.labels",
        "spec.template.spec.containers",
    ],
    "ConfigMap": ["metadata.name", "data"],
    "Secret": ["metadata.name"],
    "PersistentVolumeClaim": [
        "metadata.name",
        "spec.accessModes",
        "spec.resources.requests.storage",
    ],
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
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "Deployment",
        "Job",
        "PersistentVolumeClaim",
        "Secret",
        "Secret",
        "Secret",
        "Service",
        "Service",
        "Service",
        "Service",
        "StatefulSet",
        "StatefulSet",
    ]
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
    pod_labels = [
        d["spec"]["template"]["metadata"]["labels"]
        for d in docs
        if d["kind"] in ("StatefulSet", "Deployment")
    ]
    for svc in (d for d in docs if d["kind"] == "Service"):
        assert any(svc["spec"]["selector"].items() <= lab.items() for lab in pod_labels)


def _refs(node: Any, found: dict[str, set[str]]) -> None:
    """Names of the Secrets, ConfigMaps and claims a manifest refers to (anywhere in it)."""
    if isinstance(node, dict):
        if "claimName" in node:
            found["PersistentVolumeClaim"].add(node["claimName"])
        if "secretName" in node:
            found["Secret"].add(node["secretName"])
        for key, kind in (
            ("secretRef", "Secret"),
            ("secretKeyRef", "Secret"),
            ("configMapRef", "ConfigMap"),
            ("configMap", "ConfigMap"),
        ):
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
    found: dict[str, set[str]] = {
        "PersistentVolumeClaim": set(),
        "Secret": set(),
        "ConfigMap": set(),
    }
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
            commands += [
                c["args"]
                for c in doc["spec"]["template"]["spec"]["containers"]
                if c["image"].startswith("kvtier:")
            ]
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
            assert cond["condition"] == wanted and ("healthcheck" in services[dep]) == (
                dep != "minio-init"
            )
    for name in ("redis", "minio", "cache-server", "engine"):
        assert "healthcheck" in services[name], name
    assert "mc mb" in " ".join(services["minio-init"]["command"])  # the tiers' bucket exists
    # The engine reserves a GPU, so its image is the CUDA build; the daemon's is the CPU one.
    engine = services["engine"]
    assert engine["image"] == "kvtier:cuda" and "/cu" in engine["build"]["args"]["TORCH_INDEX"]
    assert services["cache-server"]["image"] == "kvtier:cpu"


def test_compose_mounts_the_model_where_the_engine_loads_it() -> None:
    """docs/deploy.md: ``KVTIER_MODEL_DIR`` is the HF directory itself, mounted at
    /models/model, the engine's --model (it was mounted at /models, so the engine looked for
    /models/model inside the user's directory)."""
    engine = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["engine"]
    model = engine["command"][engine["command"].index("--model") + 1]
    mounts = {}
    for volume in engine["volumes"]:  # SOURCE:TARGET[:ro]; SOURCE may hold ${VAR:-default}
        parts = volume.rsplit(":", 2 if volume.endswith((":ro", ":rw")) else 1)
        mounts[parts[1]] = parts[0]
    assert "KVTIER_MODEL_DIR" in mounts[model]


def test_tier_yamls_parse_with_the_real_parser() -> None:
    configmap = next(d for d in _manifests() if d["kind"] == "ConfigMap")
    texts = [
        (DEPLOY / "tiers.yaml").read_text(),
        (DEPLOY / "engine-tiers.yaml").read_text(),
        configmap["data"]["tiers.yaml"],
        configmap["data"]["engine-tiers.yaml"],
    ]
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
    result = subprocess.run(
        [*command, "-f", str(DEPLOY / "docker-compose.yml"), "config", "--quiet"],
        capture_output=True,
        text=True,
    )
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
    targets = [
        t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    ]
    assert "cache-server:5556" in targets


# -- what the manifests name is provided: files, Secret keys, hosts, ports -----------------

DOCS_DEPLOY = DEPLOY.parent / "docs" / "deploy.md"
_ETC_PATH = re.compile(r"(/(?:etc|var/lib|models)/[\w./-]+)")


def _volume_sources(spec: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Volume name -> (kind, name) of what backs it: Secret, ConfigMap or a claim."""
    out = {}
    for vol in spec.get("volumes", []):
        if "secret" in vol:
            out[vol["name"]] = ("Secret", vol["secret"]["secretName"])
        elif "configMap" in vol:
            out[vol["name"]] = ("ConfigMap", vol["configMap"]["name"])
        elif "persistentVolumeClaim" in vol:
            out[vol["name"]] = ("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"])
    for claim in spec.get("volumeClaimTemplates", []):
        out[claim["metadata"]["name"]] = ("PersistentVolumeClaim", claim["metadata"]["name"])
    return out


def _keys(doc: dict[str, Any]) -> set[str]:
    return set(doc.get("data") or {}) | set(doc.get("stringData") or {})


def test_kubernetes_files_and_secret_keys_exist() -> None:
    """Every file a container's args (or a tier file it loads) names under a mounted Secret or
    ConfigMap is a key of it; every secretKeyRef's key exists; paths on a claim are the
    user's data (a model), documented in docs/deploy.md."""
    docs = _manifests()
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    configmap = by_name[("ConfigMap", "kvtier-tiers")]
    deploy_doc = DOCS_DEPLOY.read_text()
    for doc in docs:
        if doc["kind"] not in ("StatefulSet", "Deployment"):
            continue
        pod = doc["spec"]["template"]["spec"]
        sources = _volume_sources({**pod, **doc["spec"]})
        for c in pod["containers"]:
            text = " ".join(str(a) for a in c.get("args", []) + c.get("command", []))
            names = set(_ETC_PATH.findall(text))
            for arg in c.get("args", []):  # the tier files it loads name files too
                if str(arg).startswith("/etc/kvtier/") and str(arg).endswith(".yaml"):
                    names |= set(_ETC_PATH.findall(configmap["data"][Path(arg).name]))
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            for path in names:
                mount = max(
                    (m for m in mounts if path.startswith(m + "/") or path == m),
                    key=len,
                    default=None,
                )
                assert mount is not None, (doc["metadata"]["name"], path, "not mounted")
                kind, name = sources[mounts[mount]]
                if kind == "PersistentVolumeClaim":
                    if mount != "/var/lib/kvtier":  # the daemon's own data directory
                        assert path in deploy_doc, (path, "user data not in docs/deploy.md")
                    continue
                key = path[len(mount) + 1 :]
                assert key in _keys(by_name[(kind, name)]), (
                    doc["metadata"]["name"],
                    path,
                    f"no key {key!r} in {kind} {name}",
                )
            for env in c.get("env", []):
                ref = (env.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in _keys(by_name[("Secret", ref["name"])]), ref
    admin = by_name[("Secret", "kvtier-tokens")]
    assert len(admin["stringData"]["admin-token"]) >= 16  # the daemon refuses a shorter one


def test_the_engine_asks_for_an_api_key_by_default() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _manifests()}
    engine = docs[("Deployment", "kvtier-engine")]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in engine.get("env", [])}
    ref = env["KVTIER_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref["key"] in _keys(docs[("Secret", ref["name"])])
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["engine"]
    env_files = compose.get("env_file") or []
    assert any("KVTIER_API_KEY=" in (DEPLOY / f).read_text() for f in env_files), env_files
    unit = configparser.ConfigParser(interpolation=None)
    unit.read_string((DEPLOY / "systemd" / "kvtier-engine.service").read_text())
    assert unit["Service"]["EnvironmentFile"] == "/etc/kvtier/engine.env"


def test_compose_files_and_hosts_exist() -> None:
    """Every file compose mounts or loads is shipped; every host a tier file names is a
    compose service, on a port that service listens on."""
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    ports = {"redis": 6379, "minio": 9000, "cache-server": 5555}
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), (name, source)
        for env_file in svc.get("env_file", []):
            assert (DEPLOY / env_file).is_file(), (name, env_file)
    for tier_file in ("tiers.yaml", "engine-tiers.yaml"):
        for tier in parse_tier_config(yaml.safe_load((DEPLOY / tier_file).read_text())).tiers:
            url = getattr(tier, "url", None) or getattr(tier, "endpoint_url", None)
            if not url:
                continue
            host, port = re.sub(r"^[a-z]+://", "", url).split("/")[0].split(":")
            assert host in services and ports[host] == int(port), (tier_file, url)
    tokens = (DEPLOY / "tokens.example").read_text().split()
    engine_tiers = yaml.safe_load((DEPLOY / "engine-tiers.yaml").read_text())
    assert engine_tiers["tiers"][1]["token"] in tokens  # the daemon knows the engine's token


def _deploy_table() -> dict[str, str]:
    """docs/deploy.md's table of installed files: target path -> what provides it."""
    rows = re.findall(r"^\| `(/[^`]+)` \| ([^|]+) \|", DOCS_DEPLOY.read_text(), re.M)
    return {path: source.strip() for path, source in rows}


def test_systemd_files_hosts_and_ports_are_shipped_or_documented() -> None:
    """The units' files (and the files their tier files name) are in docs/deploy.md's table,
    each from a shipped deploy/ file or marked as the user's; the units' tier files name only
    localhost, on the ports the daemon unit binds."""
    table = _deploy_table()
    named: set[str] = set()
    for unit_name in ("kvtier-cache-server.service", "kvtier-engine.service"):
        unit = configparser.ConfigParser(interpolation=None)
        unit.read_string((DEPLOY / "systemd" / unit_name).read_text())
        service = unit["Service"]
        named |= set(
            _ETC_PATH.findall(service["ExecStart"] + " " + service.get("EnvironmentFile", ""))
        )
    for source in ("tiers.yaml", "engine-tiers.yaml"):
        named |= set(_ETC_PATH.findall((DEPLOY / "systemd" / source).read_text()))
    named = {p for p in named if not p.startswith("/var/lib/kvtier/lmdb")}
    for path in sorted(named):
        if path in ("/var/lib/kvtier", "/var/log/kvtier/access.jsonl"):
            continue  # StateDirectory= / LogsDirectory= make them
        assert path in table, f"{path}: not in docs/deploy.md's table of files"
        shipped = re.match(r"`(deploy/[^`]+)`", table[path])
        assert shipped is None or (DEPLOY.parent / shipped.group(1)).is_file(), table[path]
        assert shipped is not None or "yours" in table[path], table[path]
    daemon = configparser.ConfigParser(interpolation=None)
    daemon.read_string((DEPLOY / "systemd" / "kvtier-cache-server.service").read_text())
    exec_start = daemon["Service"]["ExecStart"]
    daemon_port = int(re.search(r"--port (\d+)", exec_start).group(1))  # type: ignore[union-attr]
    local_ports = {"redis": 6379, "s3": 9000, "remote": daemon_port}
    for source in ("tiers.yaml", "engine-tiers.yaml"):
        text = (DEPLOY / "systemd" / source).read_text()
        for tier in parse_tier_config(yaml.safe_load(text)).tiers:
            url = getattr(tier, "url", None) or getattr(tier, "endpoint_url", None)
            if url:
                host, port = re.sub(r"^[a-z]+://", "", url).split("/")[0].split(":")
                assert host in ("127.0.0.1", "localhost"), (source, url)
                assert int(port) == local_ports[tier.kind], (source, url)
