"""``kvtier serve``'s stop path: the SIGTERM handler that leads ``main`` into its graceful
shutdown, the log filter that keeps its deadline's aborts to one line, and the watchdog that
stops the HTTP server once the engine died."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)


class Terminated(Exception):
    """SIGTERM, raised in the main thread outside uvicorn's own handling (uvicorn re-raises
    the signal it handled once it stopped): ``engine.server.cli.main`` catches it."""


def raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


class QuietShutdownCancel(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" traceback for a request task it
    cancelled itself when ``--shutdown-timeout`` ran out: its one "Cancel N running task(s),
    timeout graceful shutdown exceeded" line already says so, and a long stream cut there is
    the flag working, not a failure (40 lines each, per stream). Install it on
    ``uvicorn.error`` after ``uvicorn.Config`` configured logging."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(error, asyncio.CancelledError)


class EngineWatchdog:
    """Stops the HTTP server once the engine can no longer run (its core process or thread
    died), so that ``kvtier serve`` exits non-zero within ``interval_s`` and a supervisor
    restarts it, as vLLM's API server does. Requests in flight have already been failed by the
    engine client (503). ``engine_error`` is the engine's error once that happened."""

    def __init__(self, engine: Any, server: Any, interval_s: float = 0.5) -> None:
        self._engine = engine
        self._server = server
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="kvtier-engine-watchdog", daemon=True
        )
        self.engine_error: BaseException | str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self._interval_s):
            if not self._engine.is_running:
                self.engine_error = self._engine.dead_error or "the engine stopped"
                logger.error(
                    "engine is not running (%s): stopping the HTTP server", self.engine_error
                )
                self._server.should_exit = True
                return
