"""``kvtier serve``'s stop path: the SIGTERM handler that leads ``main`` into its graceful
shutdown, the log filter that keeps uvicorn's own deadline's cancellations to one line, and
the watchdog that stops the HTTP server once the engine died (or its core stalled) and ends the
requests still running when ``--shutdown-timeout`` has passed since a stop began."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
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


# After the stop deadline ended the requests in flight, how long uvicorn still waits for their
# responses (the error event, [DONE]) to go out before it cancels what is left.
STOP_GRACE_S = 1.0
_STOPPING_INTERVAL_S = 0.05  # how often the deadline is checked once a stop began


class EngineWatchdog:
    """Stops the HTTP server once the engine can no longer run (its core process or thread
    died, or its core stalled: ``engine.core.client``'s stall watch), so that ``kvtier serve``
    exits non-zero within ``interval_s`` and a supervisor restarts it, as vLLM's API server
    does. Requests in flight have already been failed by the engine client (503).
    ``engine_error`` is the engine's error once that happened.

    Once a stop began (uvicorn's ``should_exit``: SIGTERM/SIGINT), the requests still running
    ``shutdown_timeout_s`` later are ended through the engine (``end_in_flight``): each is
    aborted in the core and its client gets a 503, or an error event and ``[DONE]`` on a stream,
    saying the server stopped, instead of a connection cut mid-stream. uvicorn's own deadline
    (``STOP_GRACE_S`` later) stays as the backstop."""

    def __init__(
        self,
        engine: Any,
        server: Any,
        interval_s: float = 0.5,
        shutdown_timeout_s: float | None = None,
    ) -> None:
        self._engine = engine
        self._server = server
        self._interval_s = interval_s
        self._shutdown_timeout_s = shutdown_timeout_s
        self._wake = threading.Event()
        self._stopped = False
        # When uvicorn's signal handler ran: the --shutdown-timeout clock starts there, not when
        # the next poll notices ``should_exit`` (up to ``interval_s`` later).
        self._exit_requested_at: float | None = None
        self._thread = threading.Thread(
            target=self._watch, name="kvtier-engine-watchdog", daemon=True
        )
        self.engine_error: BaseException | str | None = None
        handle_exit = getattr(server, "handle_exit", None)
        if handle_exit is not None:  # uvicorn installs it as the SIGTERM/SIGINT handler in run()

            def on_exit_signal(sig: int, frame: Any) -> None:
                if self._exit_requested_at is None:
                    self._exit_requested_at = time.monotonic()
                self._wake.set()
                handle_exit(sig, frame)

            server.handle_exit = on_exit_signal

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        stopping_since: float | None = None
        interval = self._interval_s
        while True:
            self._wake.wait(interval)
            self._wake.clear()
            if self._stopped:
                return
            if not self._engine.is_running:
                self.engine_error = self._engine.dead_error or "the engine stopped"
                logger.error(
                    "engine is not running (%s): stopping the HTTP server", self.engine_error
                )
                self._server.should_exit = True
                return
            if self._shutdown_timeout_s is None or not self._server.should_exit:
                continue
            if stopping_since is None:
                stopping_since = self._exit_requested_at or time.monotonic()
                interval = min(interval, _STOPPING_INTERVAL_S)
            if time.monotonic() - stopping_since >= self._shutdown_timeout_s:
                self._end_in_flight()
                return

    def _end_in_flight(self) -> None:
        timeout = self._shutdown_timeout_s
        ended = self._engine.end_in_flight(
            f"the server is shutting down: request ended after --shutdown-timeout {timeout:g} s"
        )
        if ended:
            logger.warning(
                "--shutdown-timeout %g s passed: ended %d request(s) still running", timeout, ended
            )
