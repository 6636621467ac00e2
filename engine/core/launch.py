"""``CoreProcess``: spawning the engine-core process, its sockets, the readiness handshake and
stopping it. ``EngineCoreClient`` owns one; nothing here touches requests.

The API process binds both sockets (ipc:// in a fresh temp dir by default) before spawning,
so the core only connects. That directory names its owner's pid (``OWNER_FILE``): one left by
an API process killed before it could remove it (``kill -9``) is removed by the next start on
the machine (``sweep_stale_ipc_dirs``). Spawn, never fork: the API process may already hold torch state
and threads.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from engine.config import DEFAULT_STALL_TIMEOUT_S, EngineConfig
from engine.core.messages import Ready, StartupFailed, decode_event
from engine.core.proc import CoreAddresses, run_engine_core

logger = logging.getLogger(__name__)
IPC_DIR_PREFIX = "kvtier-core-"  # the sockets' temp directory, one per API process
OWNER_FILE = "owner.pid"  # in it: the API process's pid (sweep_stale_ipc_dirs)
_LAST_EVENT_GRACE_MS = 200  # after the core exits, how long its last message may trail


class EngineStartupError(RuntimeError):
    """The engine core failed to load (the message is the core's error) or exited early."""


@dataclass(frozen=True, slots=True)
class CoreProcConfig:
    """How the core process runs. ``num_threads``: torch intra-op threads in the core (None:
    torch's default); ``startup_timeout_s``: None waits as long as the model takes to load;
    ``ipc_dir``: where the ipc:// sockets live (None: a fresh temp dir, removed at close);
    ``log_level``: the core's logging level (None: logging left unconfigured there);
    ``stall_timeout_s``: once the core is ready, how long it may send nothing before it is
    declared stalled (``EngineCoreClient``: its requests fail, it is killed at shutdown); None:
    never."""

    num_threads: int | None = None
    startup_timeout_s: float | None = None
    ipc_dir: str | None = None
    log_level: str | None = None
    stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.startup_timeout_s is not None and self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")
        if self.stall_timeout_s is not None and self.stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be > 0 (None: off), got {self.stall_timeout_s}")


class CoreProcess:
    """The spawned core and the API ends of its two sockets. ``requests`` (PUSH) is for the
    caller to guard; ``events`` (PULL) belongs to one reader thread. Not thread-safe."""

    def __init__(
        self,
        proc: Any,
        zmq_ctx: zmq.Context,
        requests: zmq.Socket,
        events: zmq.Socket,
        owned_dir: str | None,
    ) -> None:
        self.proc = proc  # a started multiprocessing.Process
        self.zmq_ctx = zmq_ctx
        self.requests = requests
        self.events = events
        self._owned_dir = owned_dir  # the temp dir of the sockets, removed at close
        # The core ignores SIGTERM, so multiprocessing's own exit hook (terminate, then join
        # without a timeout) would wait forever for a core nobody stopped; this hook runs
        # before it (registered later) and kills such a core.
        atexit.register(self._kill_at_exit)

    def _kill_at_exit(self) -> None:
        if self.proc.is_alive():
            logger.warning("engine core still running at exit (never shut down): killing it")
            self.proc.kill()
            self.proc.join()

    @classmethod
    def spawn(cls, config: EngineConfig, proc_config: CoreProcConfig) -> CoreProcess:
        """Binds the sockets and starts the process (returns at once; see ``wait_ready``)."""
        owned_dir = None
        if not proc_config.ipc_dir:
            sweep_stale_ipc_dirs(tempfile.gettempdir())
            owned_dir = tempfile.mkdtemp(prefix=IPC_DIR_PREFIX)
            Path(owned_dir, OWNER_FILE).write_text(str(os.getpid()))
        ipc_dir = proc_config.ipc_dir or owned_dir
        addresses = CoreAddresses(f"ipc://{ipc_dir}/requests", f"ipc://{ipc_dir}/events")
        zmq_ctx = zmq.Context()
        requests = zmq_ctx.socket(zmq.PUSH)
        requests.setsockopt(zmq.SNDHWM, 0)  # queue without limit while the core is busy
        requests.bind(addresses.requests)
        events = zmq_ctx.socket(zmq.PULL)
        events.bind(addresses.events)
        proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(config, addresses, proc_config.num_threads, proc_config.log_level),
            name="kvtier-engine-core",
            daemon=True,  # torn down with the API process even if nobody calls stop()
        )
        proc.start()
        return cls(proc, zmq_ctx, requests, events, owned_dir)

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the process exits."""
        return int(self.proc.sentinel)

    def wait_ready(self, timeout_s: float | None) -> Ready:
        """Blocks until the core's first event. Raises EngineStartupError (with the core's
        message) unless it is Ready; the caller then ``close``s."""
        poller = zmq.Poller()
        poller.register(self.events, zmq.POLLIN)
        poller.register(self.sentinel, zmq.POLLIN)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1e3))
            ready = dict(poller.poll(wait_ms))
            exited = self.sentinel in ready
            if self.events in ready or (exited and self.events.poll(_LAST_EVENT_GRACE_MS)):
                event = decode_event(self.events.recv())
                if isinstance(event, Ready):
                    return event
                if isinstance(event, StartupFailed):
                    raise EngineStartupError(f"engine core failed to start: {event.message}")
                raise EngineStartupError(f"unexpected first event {type(event).__name__}")
            if exited:
                self.proc.join(1.0)
                code = self.proc.exitcode
                raise EngineStartupError(f"engine core process exited with code {code} early")
            if deadline is not None and time.monotonic() >= deadline:
                raise EngineStartupError(f"engine core not ready within {timeout_s} s")

    def stop(self, timeout_s: float) -> int | None:
        """Waits up to ``timeout_s`` for the process to exit (after a Shutdown message), then
        kills it (the core ignores SIGTERM). Returns its exit code as it exited by itself
        (``engine.core.drain``: 0 drained, 3 drain incomplete, 1 failed, -N killed by signal N
        before), or ``-SIGKILL`` when it had to be killed here. Idempotent."""
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            if timeout_s > 0:  # close() kills at once on purpose
                logger.error("engine core did not stop within %.0f s: killing it", timeout_s)
            self.proc.kill()
            self.proc.join()
        return self.proc.exitcode

    def close(self) -> None:
        """Stops the process now if it still runs, closes the sockets, removes the temp dir.
        Call once the ``events`` reader is done."""
        self.stop(0.0)
        atexit.unregister(self._kill_at_exit)
        self.requests.close(linger=0)
        self.events.close(linger=0)
        self.zmq_ctx.term()
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)


def sweep_stale_ipc_dirs(parent: str) -> int:
    """Remove the socket directories (``kvtier-core-*`` in ``parent``) of API processes that
    died without closing them (``kill -9``: no ``close`` ran): each names its owner's pid in
    ``OWNER_FILE``, and one whose owner is gone is removed. A directory without that file, or
    whose owner lives (or whose pid was reused), is left alone. Returns how many were
    removed; never raises."""
    removed = 0
    try:
        entries = [e for e in os.scandir(parent) if e.name.startswith(IPC_DIR_PREFIX)]
    except OSError:
        return 0
    for entry in entries:
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid():
                continue
            pid = int(Path(entry.path, OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if _alive(pid):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed += 1
    if removed:
        logger.info("removed %d socket directories of engines that died unclosed", removed)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
