"""``EngineCoreClient``: the API process's handle on an engine core running in its own process.

``start`` spawns ``engine.core.proc.run_engine_core``, binds the two ZMQ sockets (ipc:// in a
fresh temp dir), loads the tokenizer while the core loads the model, and waits for the core's
``Ready`` (``EngineStartupError`` carries the core's message if it fails). A background thread
then reads ``StepOutputs``, detokenizes them (``output_processor``), and hands each request's
outputs to its asyncio consumer. It also watches the core's process sentinel: if the core
dies, every pending and later request fails with ``EngineDeadError`` and ``is_running`` turns
False (``/health`` answers 503). The API process never runs model work, so it stays
responsive during long prefills.

A core that still runs but says nothing is as useless as a dead one: a step stuck in a CUDA
call or a collective, a process stopped (``kill -STOP``). The same thread watches for that
(``StallWatch``): every message from the core is progress (each step's outputs, the idle
core's stats every few seconds, its answer to a ``StatsRequest`` this thread sends once half
the timeout passed in silence, which covers timeouts shorter than the idle period). After
``stall_timeout_s`` of silence the core is declared stalled: ``EngineStalledError`` for every
pending and later request, ``is_running`` False, a SIGUSR1 to the core so that its threads'
stacks (where it is stuck) reach the log, and ``shutdown`` kills it at once instead of waiting
for a drain it cannot do. A single step longer than the timeout is indistinguishable from a
stuck one, hence a generous default (``DEFAULT_STALL_TIMEOUT_S``).

Why a thread rather than an asyncio task: one client serves whichever event loops call it
(uvicorn's, or several successive ``asyncio.run`` in tests), and the thread blocks in
``zmq.Poller`` on the socket and the process sentinel together.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import zmq

from engine.config import DEFAULT_STALL_TIMEOUT_S, EngineConfig
from engine.core.base import (
    EngineDeadError,
    EngineStalledError,
    EngineStats,
    OutputStream,
    StreamEntry,
    StreamingFrontEnd,
)
from engine.core.drain import describe_exit
from engine.core.launch import CoreProcConfig, CoreProcess, EngineStartupError
from engine.core.messages import (
    AbortRequests,
    AddRequest,
    CoreEvent,
    CoreFailed,
    Ready,
    RequestRejected,
    Shutdown,
    StatsRequest,
    StepOutputs,
    decode_event,
    encode_request,
)
from engine.core.output_processor import RequestState, core_params
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import encode_prompt, load_tokenizer

__all__ = ["CoreProcConfig", "EngineCoreClient", "EngineStartupError", "StallWatch"]
logger = logging.getLogger(__name__)
_LAST_EVENTS_GRACE_MS = 200  # after the core exits, how long its last messages may trail
_STALL_TICK_MAX_S = 1.0  # how often, at most, the output thread wakes to judge the silence


class StallWatch:
    """How long the engine core has said nothing, as the output thread saw it, and what to do
    about it. The thread calls ``heard`` on every message and ``tick`` on every other wake-up
    (it polls at least every ``tick_s``); ``tick`` answers ``PING`` once the silence reached
    half of ``timeout_s`` (ask the core for its stats: an idle one answers at once, a busy one
    after its step), ``STALLED`` once it reached ``timeout_s``, else None.

    Silence counts only time this thread was awake to watch: a wake-up adds the time since the
    one before, but at most one tick. A whole process group stopped and resumed (Ctrl-Z and
    ``fg``, ``docker pause``, a cgroup freezer) would otherwise find, on waking, minutes of
    silence that the core, stopped too, is not to blame for; after such a pause the core still
    has most of a timeout to answer the ping. An API process too busy to wake this thread on
    time only delays the verdict. Not thread-safe: the output thread's."""

    PING = "ping"
    STALLED = "stalled"

    def __init__(self, timeout_s: float, now: float) -> None:
        self.timeout_s = timeout_s
        self.tick_s = min(_STALL_TICK_MAX_S, timeout_s / 8)
        self.silent_s = 0.0  # watched silence, what the verdict goes by
        self.heard_at = now  # the last message (the client's start: Ready)
        self._seen_at = now  # this thread's last wake-up
        self._pinged = False

    def heard(self, now: float) -> None:
        self.silent_s = 0.0
        self.heard_at = self._seen_at = now
        self._pinged = False

    def tick(self, now: float) -> str | None:
        self.silent_s += min(max(0.0, now - self._seen_at), self.tick_s)
        self._seen_at = now
        if self.silent_s >= self.timeout_s:
            return self.STALLED
        if not self._pinged and self.silent_s >= self.timeout_s / 2:
            self._pinged = True
            return self.PING
        return None


@dataclass(slots=True)
class _Entry(StreamEntry):
    state: RequestState  # touched by the output thread only


class EngineCoreClient(StreamingFrontEnd):
    """Satisfies ``engine.core.base.EngineClient``; build it with ``start``. Thread-safe."""

    def __init__(
        self,
        core: CoreProcess,
        tokenizer: Any,
        ready: Ready,
        stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S,
    ) -> None:
        """``stall_timeout_s``: how long the core may send nothing before it is declared
        stalled (module docstring); None: never."""
        self._core = core
        self._requests_sock = core.requests  # guarded by _send_lock
        self._events_sock = core.events  # owned by the output thread
        self.tokenizer = tokenizer
        self.model_name: str = ready.model_name
        self.max_model_len: int = ready.max_model_len
        self.core_pid: int = ready.pid
        self._stats: EngineStats = ready.stats  # replaced, never mutated
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._entries: dict[str, StreamEntry] = {}  # guarded by _lock; each an _Entry
        self._dead: BaseException | None = None
        self._stopping = False
        self._shutdown_problem: str | None = None  # what shutdown() returned
        self._stall_timeout_s = stall_timeout_s
        self._thread = threading.Thread(
            target=self._output_loop, name="kvtier-core-outputs", daemon=True
        )
        self._thread.start()

    @classmethod
    def start(
        cls, config: EngineConfig, proc_config: CoreProcConfig | None = None
    ) -> EngineCoreClient:
        """Spawns the core and returns once it has loaded the model. Raises
        EngineStartupError (with the core's message) if it cannot."""
        proc_config = proc_config or CoreProcConfig()
        from engine.models.sources import resolve_model_dir

        # Before the spawn, so that only one process builds the demo model or converts a GGUF.
        try:
            model_dir = resolve_model_dir(config.model, dtype=config.dtype, device=config.device)
        except (OSError, ValueError, ImportError) as exc:
            raise EngineStartupError(str(exc)) from exc
        core = CoreProcess.spawn(config, proc_config)
        try:
            tokenizer, tokenizer_error = None, None
            try:
                # overlaps with the core's model load
                tokenizer = load_tokenizer(config.tokenizer or model_dir)
            except ValueError as exc:
                tokenizer_error = exc  # the core's own verdict on the directory comes first
            ready = core.wait_ready(proc_config.startup_timeout_s)
            if tokenizer_error is not None:
                raise EngineStartupError(str(tokenizer_error)) from tokenizer_error
        except BaseException:
            core.close()
            raise
        return cls(core, tokenizer, ready, proc_config.stall_timeout_s)

    # --- the EngineClient interface -----------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stopping and self._core.proc.is_alive()

    def request_stats(self) -> None:
        """Asks the core for fresh stats; ``stats()`` shows them once they arrive."""
        self._send(encode_request(StatsRequest()))

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        req_id: str,
        *,
        arrival_time: float | None = None,
        api_times: dict[str, float] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Same contract as ``AsyncEngine.generate``: one output per core step that touched the
        request, the last ``finished``; ValueError for a rejected request, EngineDeadError if
        the core stops; closing the iterator early aborts the request in the core."""
        prompt_ids = encode_prompt(self.tokenizer, prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        try:
            data = encode_request(
                AddRequest(req_id, prompt_ids, core_params(params), arrival, dict(api_times or {}))
            )
        except TypeError as exc:
            raise ValueError(f"sampling params cannot be sent to the engine core: {exc}") from exc
        state = RequestState.new(self.tokenizer, req_id, prompt_ids, params, arrival)
        stream = OutputStream(asyncio.get_running_loop())
        self._open(req_id, _Entry(stream, state))
        try:
            self._send(data)
        except EngineDeadError:
            with self._lock:
                self._entries.pop(req_id, None)
            raise
        async for output in self._outputs(req_id, stream):
            yield output

    def shutdown(self, timeout_s: float = 30.0) -> str | None:
        """Stops the core after its current step (killing it after ``timeout_s``: long enough
        for its KV offload to drain the write-through queues and flush host-only blocks, up to
        ``drain_timeout_s`` each); waiting requests get EngineDeadError. Returns None when the
        core stopped as asked and its KV drain completed, else why not in one line (it died
        before, was killed, or its drain lost blocks). Idempotent (later calls return the
        first answer)."""
        with self._lock:
            already, self._stopping = self._stopping, True
            died_before = self._dead
        if already:
            return self._shutdown_problem
        stalled = isinstance(died_before, EngineStalledError)
        try:
            self._send(encode_request(Shutdown()))
        except EngineDeadError:
            pass  # already gone
        if stalled:  # it would not read Shutdown, let alone drain: no use waiting
            logger.error("killing the stalled engine core (pid %d)", self.core_pid)
        code = self._core.stop(0.0 if stalled else timeout_s)
        problem = describe_exit(code)
        if stalled:
            problem = f"{died_before}; {problem or 'it stopped by itself before the kill'}"
        elif died_before is not None:
            problem = f"the engine core died before shutdown ({died_before})"
        self._shutdown_problem = problem
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        self._fail_all(EngineDeadError("engine shut down"))
        with self._send_lock:
            self._requests_sock.close(linger=0)
        if not self._thread.is_alive():
            self._core.close()
        return problem

    # --- internals ------------------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        with self._send_lock:
            if self._requests_sock.closed:
                raise EngineDeadError("engine shut down")
            try:
                # NOBLOCK: with no high-water mark, Again means the core is not connected.
                self._requests_sock.send(data, zmq.NOBLOCK)
            except zmq.Again as exc:
                raise EngineDeadError("engine core is not connected") from exc

    def _abort_nowait(self, req_id: str) -> None:
        with self._lock:
            entry = self._entries.pop(req_id, None)
        if entry is not None:
            self._send_abort(req_id)

    def _send_abort(self, req_id: str) -> None:
        try:
            self._send(encode_request(AbortRequests([req_id])))
        except EngineDeadError:
            pass  # a dead core runs nothing

    def _output_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._events_sock, zmq.POLLIN)
        poller.register(self._core.sentinel, zmq.POLLIN)
        watch = None
        if self._stall_timeout_s is not None:
            watch = StallWatch(self._stall_timeout_s, time.monotonic())
        poll_ms = None if watch is None else max(1, round(watch.tick_s * 1000))
        try:
            while True:
                events = dict(poller.poll(poll_ms))
                heard = self._events_sock in events and self._drain_events()
                if self._core.sentinel in events:
                    break
                if watch is not None and not self._watch_progress(watch, heard):
                    watch, poll_ms = None, None  # stalled or stopping: nothing left to watch
            # The core exited: take the messages it sent last, then fail what is left.
            while self._events_sock.poll(_LAST_EVENTS_GRACE_MS):
                self._drain_events()
        except Exception as exc:  # noqa: BLE001 - the client cannot go on without its reader
            logger.exception("engine core output thread failed")
            self._set_dead(EngineDeadError(f"engine core output thread failed: {exc!r}"))
        if not self._stopping and self._dead is None:
            self._core.proc.join(1.0)
            code = self._core.proc.exitcode
            logger.error("engine core process died (exit code %s)", code)
            self._set_dead(EngineDeadError(f"engine core process died (exit code {code})"))
        self._fail_all(self._dead or EngineDeadError("engine shut down"))

    def _watch_progress(self, watch: StallWatch, heard: bool) -> bool:
        """One wake-up of the stall watch (module docstring); False once watching is over."""
        if self._stopping or self._dead is not None:
            return False  # shutdown has its own deadline; a dead core has its own verdict
        now = time.monotonic()
        if heard:
            watch.heard(now)
            return True
        verdict = watch.tick(now)
        if verdict == StallWatch.PING:
            try:
                self._send(encode_request(StatsRequest()))
            except EngineDeadError:
                pass  # shut down meanwhile: the next wake-up ends the watch
        elif verdict == StallWatch.STALLED:
            self._declare_stalled(watch)
            return False
        return True

    def _declare_stalled(self, watch: StallWatch) -> None:
        error = EngineStalledError(
            f"engine core stalled: no message from it for "
            f"{time.monotonic() - watch.heard_at:.1f} s "
            f"(stall timeout {watch.timeout_s:g} s)"
        )
        with self._lock:
            if self._dead is not None or self._stopping:
                return
            self._dead = error
        logger.error(
            "%s: a step stuck, or its process (pid %d) stopped; failing its requests. Its "
            "threads' stacks follow if it can still take a signal (SIGUSR1)",
            error,
            self.core_pid,
        )
        try:  # the core's faulthandler writes them to stderr, the server's log
            os.kill(self.core_pid, signal.SIGUSR1)
        except OSError:
            pass  # exited meanwhile: the sentinel says so next
        self._fail_all(error)

    def _drain_events(self) -> bool:
        """Handles every message waiting; True when there was one."""
        heard = False
        while True:
            try:
                data = self._events_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return heard
            heard = True
            try:
                event = decode_event(data)
            except ValueError as exc:
                # Which requests' outputs it carried is unknown: dropping it would leave them
                # waiting for good. The core and the API disagree (a version mismatch, a
                # corrupted frame): handled as the core's own failure report, so its
                # requests fail and the server exits for its supervisor to restart it.
                logger.error("engine core sent a malformed message: %s", exc)
                event = CoreFailed(
                    f"engine core sent a malformed message ({exc}); the API and the core disagree"
                )
            self._handle(event)

    def _handle(self, event: CoreEvent) -> None:
        if isinstance(event, StepOutputs):
            # Stats first: a client that sees its output sees the stats of that step with it.
            self._stats = event.stats
            ready: list[tuple[OutputStream, RequestOutput | BaseException]] = []
            for core_output in event.outputs:
                with self._lock:
                    entry = self._entries.get(core_output.req_id)
                if entry is None:
                    continue  # aborted, or ended by a stop string while the core ran ahead
                assert isinstance(entry, _Entry)
                processed = entry.state.process(core_output)
                if processed.output.finished:
                    with self._lock:
                        self._entries.pop(core_output.req_id, None)
                if processed.abort_in_core:
                    self._send_abort(core_output.req_id)
                ready.append((entry.stream, processed.output))
            OutputStream.put_all(ready)
        elif isinstance(event, RequestRejected):
            with self._lock:
                entry = self._entries.pop(event.req_id, None)
            if entry is not None:
                entry.stream.put(ValueError(event.message))
        elif isinstance(event, CoreFailed):
            self._set_dead(EngineDeadError(event.message))
            self._fail_all(self._dead or EngineDeadError(event.message))
        else:
            logger.warning("unexpected engine core event %s", type(event).__name__)

    def _set_dead(self, error: BaseException) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = error
