"""Real Redis and S3 (moto) servers for tests, started as child processes on free loopback ports.

``RedisServer`` runs /usr/bin/redis-server without persistence in a temp dir; ``S3Server`` runs
moto's server mode (``python -m moto.server``) in a subprocess, so that a test can SIGKILL it
and the rest of the test process keeps running. Both can be stopped and started again on the
same port (a restarted moto server starts empty; a restarted redis-server too: no persistence).

``external_redis`` / ``external_s3`` wrap servers someone else runs (KVTIER_TEST_REDIS_URL,
KVTIER_TEST_S3_ENDPOINT): they cannot be stopped, and ``managed`` is False so that fault tests
skip. Environment variables are read in tests/conftest.py only, never here.

Not thread-safe: one test thread drives a server's lifecycle.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

REDIS_SERVER_BIN = "/usr/bin/redis-server"
# moto accepts any credentials; they are passed to boto3 explicitly, never through os.environ.
S3_ACCESS_KEY = "kvtier-test"
S3_SECRET_KEY = "kvtier-test-secret"
S3_REGION = "us-east-1"


def python_env(**extra: str) -> dict[str, str]:
    """The environment for a ``python -m engine.cli ...`` child: this checkout first on
    PYTHONPATH, whatever the caller's PYTHONPATH held after it (the GPU host keeps its wheels
    in /tmp/site there), plus ``extra``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def wait_until_healthy(base_url: str, proc: subprocess.Popen[Any], timeout_s: float) -> None:
    """Return once ``GET base_url/health`` answers 200 (a ``kvtier serve`` child coming up).
    Raises AssertionError when ``proc`` exits first (with its stderr when that is a pipe) or
    ``timeout_s`` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr is not None else ""
            raise AssertionError(f"kvtier serve exited early ({proc.returncode}) {err}")
        assert time.monotonic() < deadline, "kvtier serve did not come up"
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for_port(port: int, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited early with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"server on port {port} did not accept connections within {timeout_s}s")


class _ChildServer:
    """Lifecycle shared by both servers: start/stop/kill one child process on a fixed port."""

    managed = True
    startup_timeout_s = 20.0

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _cwd(self) -> str | None:
        return None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (another process may kill it)."""
        return self._proc.pid if self.running else None  # type: ignore[union-attr]

    def start(self) -> None:
        """Start the server (no-op if running); blocks until the port accepts connections."""
        if self.running:
            return
        self._proc = subprocess.Popen(
            self._command(),
            cwd=self._cwd(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C on pytest must not reach it before cleanup does
        )
        _wait_for_port(self.port, self._proc, self.startup_timeout_s)

    def stop(self) -> None:
        """SIGTERM and wait; idempotent."""
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL (a crash, no clean shutdown) and wait; idempotent."""
        self._end(signal.SIGKILL)

    def ensure_running(self) -> None:
        if not self.running:
            self.start()

    def _end(self, sig: int) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is also free and below 65536."""
    for _ in range(100):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


class RedisServer(_ChildServer):
    """A private redis-server: no RDB/AOF persistence, data only in memory.

    ``cluster=True`` runs a one-node Redis Cluster owning all 16384 slots: cheap, and enough to
    exercise the cluster client path (slot map, MOVED handling, cluster pipelines).
    """

    def __init__(
        self, port: int | None = None, maxmemory_bytes: int = 0, cluster: bool = False
    ) -> None:
        super().__init__(port or (_cluster_port() if cluster else None))
        self.maxmemory_bytes = maxmemory_bytes
        self.cluster = cluster
        self._dir = tempfile.mkdtemp(prefix="kvtier-redis-")

    @property
    def url(self) -> str:
        if self.cluster:
            return f"redis+cluster://127.0.0.1:{self.port}"
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (no-op if running); a cluster node also claims every slot and waits for OK."""
        if self.running:
            return
        if self.cluster:  # a restarted node must not reload a stale slot map
            shutil.rmtree(self._dir, ignore_errors=True)
            os.makedirs(self._dir)
        super().start()
        if self.cluster:
            import redis

            client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)
            try:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
                deadline = time.monotonic() + self.startup_timeout_s
                while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                    if time.monotonic() > deadline:
                        raise RuntimeError("one-node Redis Cluster did not reach state ok")
                    time.sleep(0.05)
            finally:
                client.close()

    def _cwd(self) -> str | None:
        return self._dir

    def _command(self) -> list[str]:
        cmd = [
            REDIS_SERVER_BIN, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", self._dir,
            "--protected-mode", "no", "--loglevel", "warning",
        ]  # fmt: skip
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        if self.maxmemory_bytes:
            cmd += ["--maxmemory", str(self.maxmemory_bytes), "--maxmemory-policy", "allkeys-lru"]
        return cmd

    def client(self) -> Any:
        """A plain redis-py client (for planting values and flushing)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def flush(self) -> None:
        """Remove every key in every database (tests start from an empty server)."""
        client = self.client()
        try:
            client.flushall()
        finally:
            client.close()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


class S3Server(_ChildServer):
    """moto's S3-compatible server in a subprocess (state lives in that process only)."""

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]

    def credentials(self) -> dict[str, str]:
        """Explicit boto3 keyword arguments (keys and region) for this server."""
        return {
            "aws_access_key_id": S3_ACCESS_KEY,
            "aws_secret_access_key": S3_SECRET_KEY,
            "region_name": S3_REGION,
        }

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            config=Config(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1}),
            **self.credentials(),
        )

    def create_bucket(self, name: str | None = None) -> str:
        """Create a fresh, uniquely named bucket and return its name."""
        bucket = name or f"kvtier-test-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=bucket)
        return bucket

    def delete_bucket(self, bucket: str) -> None:
        """Delete ``bucket`` and everything in it; ignores a bucket (or server) already gone."""
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client()
        try:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                objs = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if objs:
                    client.delete_objects(Bucket=bucket, Delete={"Objects": objs})
            client.delete_bucket(Bucket=bucket)
        except (BotoCoreError, ClientError):
            pass

    def cleanup(self) -> None:
        self.stop()


@dataclass
class ExternalRedis:
    """A Redis someone else runs (KVTIER_TEST_REDIS_URL): flushable, not restartable."""

    url: str
    managed = False
    running = True

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5)

    def flush(self) -> None:
        client = self.client()
        try:
            client.flushdb()  # only our database: an external server may hold others
        finally:
            client.close()

    def start(self) -> None:
        pass

    def ensure_running(self) -> None:
        pass

    def stop(self) -> None:
        raise RuntimeError("cannot stop an external Redis (KVTIER_TEST_REDIS_URL)")

    kill = stop

    def cleanup(self) -> None:
        pass


class ExternalS3(S3Server):
    """An S3 endpoint someone else runs (KVTIER_TEST_S3_ENDPOINT): buckets only, no lifecycle.

    Credentials come from the given keys, or from boto3's usual chain when both are None.
    """

    managed = False

    def __init__(
        self, endpoint_url: str, access_key: str | None = None, secret_key: str | None = None
    ) -> None:
        super().__init__(port=0)
        self._endpoint = endpoint_url
        self._access_key = access_key
        self._secret_key = secret_key

    @property
    def endpoint_url(self) -> str:
        return self._endpoint

    @property
    def running(self) -> bool:
        return True

    def credentials(self) -> dict[str, str]:
        creds = {"region_name": S3_REGION}
        if self._access_key and self._secret_key:
            creds |= {"aws_access_key_id": self._access_key,
                      "aws_secret_access_key": self._secret_key}  # fmt: skip
        return creds

    def start(self) -> None:
        pass

    def stop(self) -> None:
        raise RuntimeError("cannot stop an external S3 endpoint (KVTIER_TEST_S3_ENDPOINT)")

    kill = stop

    def cleanup(self) -> None:
        pass


@contextlib.contextmanager
def cache_server_process(
    tmp_path: Any, token: str, tenant: str, data_subdir: str = "data"
) -> Iterator[int]:
    """A small ``kvtier cache-server`` process (4 MiB host tier of 64 KiB slots over a 64 MiB
    LMDB in ``tmp_path/data_subdir``, no admin port) accepting ``token`` for ``tenant``; yields its port
    once it listens, stops it (SIGTERM, then waits) after."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    port = free_port()
    (Path(tmp_path) / "tokens").write_text(f"{token} {tenant}\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine.cli",
            "cache-server",
            "--port",
            str(port),
            "--admin-port",
            "-1",
            "--data-dir",
            str(Path(tmp_path) / data_subdir),
            "--lmdb-capacity",
            "64MiB",
            "--host-capacity",
            "4MiB",
            "--host-slot-bytes",
            "64KiB",
            "--tokens",
            str(Path(tmp_path) / "tokens"),
        ],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and "listening" in proc.stdout.readline()
        yield port
    finally:
        proc.terminate()
        proc.wait(30)
