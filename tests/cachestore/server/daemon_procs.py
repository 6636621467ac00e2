"""``kvtier cache-server`` as a child process, for the daemon tests that need a real one
(signals, SIGKILL, process memory, the CLI), and what they read off it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
CACHE_SERVER = [sys.executable, "-m", "engine.cli", "cache-server"]


def spawn_daemon(*args: str, stderr: bool = True, **popen: Any) -> subprocess.Popen[str]:
    """``kvtier cache-server ARGS`` from the repository root, stdout (and, with ``stderr``,
    stderr) piped as text; ``popen``: more ``subprocess.Popen`` arguments (``env``,
    ``start_new_session``). Does not wait for it."""
    return subprocess.Popen(
        [*CACHE_SERVER, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if stderr else None,
        text=True,
        **popen,
    )


def start_daemon(*args: str, expect: str = "listening", **kwargs: Any) -> subprocess.Popen[str]:
    """``spawn_daemon``, then wait for its first line: it says it is listening (``expect``)."""
    proc = spawn_daemon(*args, **kwargs)
    assert proc.stdout is not None and expect in proc.stdout.readline()
    return proc


@contextmanager
def running_daemon(*args: str) -> Iterator[subprocess.Popen[str]]:
    """``start_daemon`` (stderr not piped), terminated and reaped on the way out."""
    proc = start_daemon(*args, stderr=False)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(30)


def proc_status_kib(pid: int, field: str) -> int:
    """A ``/proc/PID/status`` memory field (``VmRSS``, ``RssAnon``), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


def rss_bytes(pid: int) -> int:
    """The process's resident set (VmRSS), in bytes."""
    return proc_status_kib(pid, "VmRSS") * 1024


def zmtp_greeting(mechanism: bytes) -> bytes:
    """A ZMTP 3.1 greeting offering ``mechanism`` (``NULL``, ``PLAIN``), as a peer sends it."""
    return b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x01" + mechanism.ljust(20, b"\0") + b"\0" * 32
