"""``kvtier cache-server`` as a user starts it: the README's tier file (the engine's
``--kv-offload-config``) runs in the daemon and in the engine; a taken ZMQ or admin port, an
address this machine lacks or a port out of range is one line and exit code 2 before anything
starts; ``/health`` reports each tier's state as the engine's does (a Redis refusing
connections is ``down`` and the status ``degraded``); the start-up block lists the tiers with
timestamps; ``--help`` shows every default."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.cachestore.server.daemon_procs import CACHE_SERVER, ROOT, spawn_daemon
from tests.servers import free_port, python_env
from tiers.lmdb import LmdbTier

pytestmark = pytest.mark.timeout(120)
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d "


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CACHE_SERVER, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=python_env(),
    )


def _spawn(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return spawn_daemon(*args, env=python_env(**(env or {})))


def _one_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 or lines[-1].startswith("kvtier cache-server: error:"), lines
    return lines[-1]


def _readme_tier_file() -> str:
    """The README's tier list (the first ```yaml block)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```yaml\n(tiers:\n.*?)```", readme, re.S)
    assert block is not None
    return block.group(1)


def _local(text: str, tmp_path: Path, redis_url: str, s3_endpoint: str, bucket: str) -> str:
    """The README's file with this test's servers and paths, and a small host tier."""
    assert "redis://127.0.0.1:6379/0" in text and "http://127.0.0.1:9000" in text
    text = text.replace("redis://127.0.0.1:6379/0", redis_url)
    text = text.replace("http://127.0.0.1:9000", s3_endpoint)
    text = text.replace("bucket: kvtier", f"bucket: {bucket}")
    text = text.replace("/var/lib/kvtier/lmdb", str(tmp_path / "lmdb"))
    return re.sub(r"kind: host, capacity: \w+", "kind: host, capacity: 16MiB", text)


def _s3_env(s3_server) -> dict[str, str]:  # type: ignore[no-untyped-def]
    creds = s3_server.credentials()
    return {
        "AWS_ACCESS_KEY_ID": creds.get("aws_access_key_id", "testing"),
        "AWS_SECRET_ACCESS_KEY": creds.get("aws_secret_access_key", "testing"),
        "AWS_DEFAULT_REGION": creds.get("region_name", "us-east-1"),
    }


def _wait_health(port: int, proc: subprocess.Popen[str]) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, proc.communicate()
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
        except httpx.HTTPError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_the_readme_tier_file_runs_in_the_daemon(
    tmp_path: Path, redis_url: str, s3_server, s3_bucket: str
) -> None:
    tiers = tmp_path / "tiers.yaml"
    tiers.write_text(
        "decision: cost\n"
        + _local(_readme_tier_file(), tmp_path, redis_url, s3_server.endpoint_url, s3_bucket)
    )
    admin = free_port()
    proc = _spawn(
        "--port", "0", "--admin-port", str(admin), "--config", str(tiers), env=_s3_env(s3_server)
    )
    try:
        assert proc.stdout is not None
        block = [proc.stdout.readline() for _ in range(6)]
        assert re.match(
            STAMP + r"kvtier cache-server listening on tcp://127\.0\.0\.1:\d+, "
            rf"admin http://127\.0\.0\.1:{admin}$",
            block[0],
        ), block
        assert re.match(STAMP + r"  tier 0  host   16MiB of memory, slots of 4MiB$", block[1])
        assert f"tier 1  lmdb   max 100GiB at {tmp_path / 'lmdb'}, write-through" in block[2]
        assert f"tier 2  redis  {redis_url}" in block[3]
        assert f"tier 3  s3     s3://{s3_bucket}/kv/ via {s3_server.endpoint_url}" in block[4]
        assert block[5].endswith(f"{tiers}: engine settings ignored here: decision\n")
        health = _wait_health(admin, proc)
        assert health["status"] == "ok"
        assert health["tiers"] == [
            {"name": n, "state": "up"} for n in ("host", "lmdb", "redis", "s3")
        ]
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert re.search(STAMP + r"kvtier cache-server stopped \(drained\)", out)


def test_the_readme_tier_file_runs_in_the_engine(
    tmp_path: Path, redis_url: str, s3_server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from tests.engine.hf_models import make_tiny_model

    for key, value in _s3_env(s3_server).items():
        monkeypatch.setenv(key, value)
    tiers = tmp_path / "tiers.yaml"
    tiers.write_text(
        "calibrate: false\n"
        + _local(_readme_tier_file(), tmp_path, redis_url, s3_server.endpoint_url, s3_bucket)
    )
    model = make_tiny_model(tmp_path / "model", "llama", seed=3)
    with LLM(
        model,
        device="cpu",
        num_gpu_blocks=32,
        max_model_len=256,
        kv_offload=True,
        kv_offload_config=str(tiers),
    ) as llm:
        out = llm.generate(["hello " * 40], SamplingParams(max_tokens=2, temperature=0))
        assert len(out[0].token_ids) == 2
        stats = llm.kv_stats()
    names = [row["name"] for row in stats["store"]["tiers"]]
    assert names == ["host", "lmdb", "redis", "s3"]


def test_taken_ports_and_bad_binds_are_one_line_exit_2(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _one_error(
            _cli("--port", str(port), "--admin-port", "-1", "--data-dir", str(tmp_path))
        )
        assert line == (
            f"kvtier cache-server: --port: cannot bind 127.0.0.1:{port}: Address already in use"
        )
        line = _one_error(
            _cli("--port", "0", "--admin-port", str(port), "--data-dir", str(tmp_path))
        )
        assert line == (
            f"kvtier cache-server: --admin-port: cannot bind 127.0.0.1:{port}: "
            "Address already in use"
        )
    line = _one_error(
        _cli(
            "--port",
            "0",
            "--admin-port",
            "-1",
            "--admin-host",
            "127.0.0.1",
            "--host",
            "192.0.2.1",
            "--tokens",
            "/dev/null",
            "--data-dir",
            str(tmp_path),
        )
    )
    assert line == (
        "kvtier cache-server: --port: cannot bind 192.0.2.1:0: Cannot assign requested address"
    )
    line = _one_error(_cli("--port", "70000"))
    assert line == (
        "kvtier cache-server: error: argument --port: invalid port 70000: a number 0..65535"
    )
    assert not (tmp_path / "lmdb").exists()  # nothing built before the checks


def test_health_says_degraded_while_redis_refuses(tmp_path: Path) -> None:
    dead = free_port()  # nothing listens there
    tiers = tmp_path / "tiers.yaml"
    tiers.write_text(
        "tiers:\n  - {kind: host, capacity: 8MiB}\n"
        f"  - {{kind: redis, url: 'redis://127.0.0.1:{dead}/0', "
        "connect_timeout_s: 0.2}\n"
    )
    admin = free_port()
    proc = _spawn("--port", "0", "--admin-port", str(admin), "--config", str(tiers))
    try:
        _wait_health(admin, proc)
        deadline = time.monotonic() + 20  # the store's prober pings idle tiers every 5 s
        while True:
            health = _wait_health(admin, proc)
            if health["status"] != "ok" or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert health["status"] == "degraded"
        assert health["tiers"] == [
            {"name": "host", "state": "up"},
            {"name": "redis", "state": "down"},
        ]
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_help_shows_every_default() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "engine.cli", "cache-server", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=python_env(),
    ).stdout
    flat = " ".join(out.split())
    for default in (
        "(default: 5555)",
        "(default: 5556)",
        "(default: 127.0.0.1)",
        "(default: 10GiB)",
        "(default: 4MiB)",
        "(default: 64MiB)",
    ):
        assert default in flat, default


def test_a_missing_tokens_file_and_no_tier_are_one_line_naming_the_flags(tmp_path: Path) -> None:
    """Audit: ``--tokens /nope`` printed a bare ``[Errno 2]``; a bare ``kvtier cache-server``
    asked for --data-dir, which its help said defaults to none."""
    nope = tmp_path / "nope"
    line = _one_error(
        _cli(
            "--port", "0", "--admin-port", "-1", "--data-dir", str(tmp_path), "--tokens", str(nope)
        )
    )
    assert line == f"kvtier cache-server: --tokens: cannot read {nope}: No such file or directory"
    (tmp_path / "tokens").write_text("tok-alice-0001\n")
    line = _one_error(
        _cli(
            "--port",
            "0",
            "--admin-port",
            "-1",
            "--host-capacity",
            "1MiB",
            "--tokens",
            str(tmp_path / "tokens"),
        )
    )
    assert line.startswith(f"kvtier cache-server: --tokens {tmp_path / 'tokens'}:1: expected")
    required = "one of --data-dir, --config or --host-capacity is required"
    assert (
        _one_error(_cli()) == f"kvtier cache-server: {required} (LMDB, a tiers YAML, host memory)"
    )
    help_text = " ".join(_cli("--help").stdout.split())
    assert (
        f"--data-dir DIR LMDB directory (persistence); default: none, but {required}" in help_text
    )
    assert not (tmp_path / "lmdb").exists()


def test_an_unreadable_lmdb_directory_starts_empty_and_a_deleted_one_is_down(
    tmp_path: Path,
) -> None:
    """The ops audit: ``--data-dir`` over a corrupt LMDB printed a 42-line traceback and never
    started. Held open by another process (which LMDB's lock shows) it is still not moved:
    one line, exit 1. Once free it is moved aside and the daemon starts on an empty one; that
    directory deleted under the running daemon, its ``/health`` says the tier is down."""
    import os
    import shutil

    import lmdb

    data = tmp_path / "lmdb"
    LmdbTier(data, capacity_bytes=1 << 20).close()
    held = lmdb.open(str(data), max_dbs=3, map_size=1 << 26)  # another engine's
    with open(data / "data.mdb", "r+b") as fh:
        fh.write(os.urandom(4 * 4096))  # dd if=/dev/urandom bs=4096 count=4 conv=notrunc
    failed = _cli("--port", "0", "--admin-port", "-1", "--data-dir", str(tmp_path))
    held.close()
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr
    line = failed.stderr.strip().splitlines()[-1]
    assert line.startswith(f"kvtier cache-server: lmdb at {data}: unreadable (")
    assert "MDB_INVALID" in line and "open by another process" in line
    assert not list(tmp_path.glob("lmdb.corrupt-*"))
    admin = free_port()
    proc = _spawn("--port", "0", "--admin-port", str(admin), "--data-dir", str(tmp_path))
    try:
        assert _wait_health(admin, proc)["status"] == "ok"
        assert len(list(tmp_path.glob("lmdb.corrupt-*"))) == 1
        shutil.rmtree(data)
        deadline = time.monotonic() + 20  # the store's prober pings idle tiers every 5 s
        while (health := _wait_health(admin, proc))["status"] == "ok":
            assert time.monotonic() < deadline, health
            time.sleep(0.5)
        assert {"name": "lmdb", "state": "down"} in health["tiers"]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "moved aside to" in err and "was deleted while the tier ran" in err
