"""``EngineCoreClient``: the API process's handle on an engine core running in its own process.

``start`` spawns ``engine.core.proc.run_engine_core``, binds the two ZMQ sockets (ipc:// in a
fresh temp dir), loads the tokenizer while the core loads the model, and waits for the core's
``Ready`` (``EngineStartupError`` carries the core's message if it fails). A background thread
then reads ``StepOutputs``, detokenizes them (``output_processor``), and hands each request's
outputs to its asyncio consumer. It also watches the core's process sentinel: if the core
dies, every pending and later request fails with ``EngineDeadError`` and ``is_running`` turns
False (``/health`` answers 503). The API process never runs model work, so it stays
responsive during long prefills.

Why a thread rather than an asyncio task: one client serves whichever event loops call it
(uvicorn's, or several successive ``asyncio.run`` in tests), and the thread blocks in
``zmq.Poller`` on the socket and the process sentinel together.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import zmq

from engine.config import EngineConfig
from engine.core.base import (
    EngineDeadError,
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

__all__ = ["CoreProcConfig", "EngineCoreClient", "EngineStartupError"]
logger = logging.getLogger(__name__)
_LAST_EVENTS_GRACE_MS = 200  # after the core exits, how long its last messages may trail


@dataclass(slots=True)
class _Entry(StreamEntry):
    state: RequestState  # touched by the output thread only


class EngineCoreClient(StreamingFrontEnd):
    """Satisfies ``engine.core.base.EngineClient``; build it with ``start``. Thread-safe."""

    def __init__(self, core: CoreProcess, tokenizer: Any, ready: Ready) -> None:
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
        return cls(core, tokenizer, ready)

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
        try:
            self._send(encode_request(Shutdown()))
        except EngineDeadError:
            pass  # already gone
        code = self._core.stop(timeout_s)
        problem = describe_exit(code)
        if died_before is not None:
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
        try:
            while True:
                events = dict(poller.poll())
                if self._events_sock in events:
                    self._drain_events()
                if self._core.sentinel in events:
                    break
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

    def _drain_events(self) -> None:
        while True:
            try:
                data = self._events_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                event = decode_event(data)
            except ValueError:
                logger.exception("dropping a malformed message from the engine core")
                continue
            self._handle(event)

    def _handle(self, event: CoreEvent) -> None:
        if isinstance(event, StepOutputs):
            # Stats first: a client that sees its output sees the stats of that step with it.
            self._stats = event.stats
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
                entry.stream.put(processed.output)
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
