"""The engine-core process: builds ``LLMEngine`` and steps it, fed and drained over ZMQ.

``EngineCoreClient`` spawns ``run_engine_core`` (multiprocessing *spawn*: never fork a process
that holds torch or threads). The core connects a PULL socket for ``CoreRequest``s and a PUSH
socket for ``CoreEvent``s to addresses the API process has bound, loads the model, reports
``Ready`` (or ``StartupFailed`` with the error's message), then loops: drain every pending
request, run one ``step()`` if any request is unfinished, push that step's outputs and stats
as one ``StepOutputs``. Going idle, it saves the last requests' KV blocks (``save_kv``) and,
a second later, sends its stats once more (the KV copies to the lower tiers ran meanwhile).
With no work it blocks in ``poll`` (no busy wait).

It stops only on ``Shutdown`` or when its parent process is gone (its sentinel), or (code 1,
after ``CoreFailed``) when a step raises; then it closes the engine, which drains the KV
offload, and exits with the verdict (``engine.core.drain``: 0, or 3 when the drain lost
blocks). SIGTERM and SIGINT are ignored: a supervisor signals the whole process group (systemd's
``KillMode=control-group``, ``kill -TERM -PGID``, Ctrl-C), and the core must outlive that signal
until the API process, which got it too, has let its HTTP requests finish and sent
``Shutdown``; dying on it would lose the host tier's blocks.
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from engine.config import EngineConfig
from engine.core.base import StatsSampler
from engine.core.drain import EXIT_FAILED, EXIT_OK, close_and_judge
from engine.core.messages import (
    AbortRequests,
    AddRequest,
    CoreEvent,
    CoreFailed,
    CoreOutput,
    CoreRequest,
    Ready,
    RequestRejected,
    Shutdown,
    StartupFailed,
    StatsRequest,
    StepOutputs,
    decode_request,
    encode_event,
)
from engine.outputs import RequestOutput

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)
_LAST_EVENTS_LINGER_MS = 5000  # time to deliver the final events (CoreFailed) before exiting
_IDLE_STATS_DELAY_S = 1.0  # after going idle, stats are sent once more this much later
# ... and then every this many seconds while idle: the store's prober keeps the tiers' health
# current without requests (cachestore/store/prober.py), and /health reads it from these. They
# are also the idle core's sign of life to the API process's stall watch (engine.core.client),
# which asks for stats (StatsRequest) when its timeout is shorter than this.
_IDLE_STATS_PERIOD_S = 5.0


@dataclass(frozen=True, slots=True)
class CoreAddresses:
    """ZMQ endpoints, bound by the API process and connected by the core."""

    requests: str  # API PUSH -> core PULL
    events: str  # core PUSH -> API PULL


def run_engine_core(
    config: EngineConfig,
    addresses: CoreAddresses,
    num_threads: int | None,
    log_level: str | None = None,
) -> None:
    """Process entry point; exits with 0 after Shutdown or parent death and a complete KV drain,
    3 (``EXIT_DRAIN_INCOMPLETE``) when the drain lost blocks, 1 on failure.
    ``num_threads``: torch intra-op threads for this process (None: torch's default);
    ``log_level``: configure logging to stderr at this level (as ``kvtier serve`` does its
    own; None: leave logging alone). A start-up failure is sent to the API process as one
    message; its traceback is logged here at debug level only."""
    if log_level is not None:
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    # A supervisor's SIGTERM and Ctrl-C's SIGINT reach the whole process group; the API process
    # decides when the core stops (Shutdown after draining HTTP; its death), so both are ignored.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # ``kill -USR1``: every thread's Python stack to stderr (the server's log), the engine
    # going on; what a stuck step or a slow tier is doing, without a debugger on the host.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(addresses.requests)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)  # never drop or block on outputs
    outbox.connect(addresses.events)
    code = EXIT_FAILED
    try:
        try:
            engine = _build_engine(config, num_threads)
        except BaseException as exc:  # noqa: BLE001 - any failure is reported to the API
            logger.debug("engine core failed to start", exc_info=True)
            outbox.send(encode_event(StartupFailed(f"{type(exc).__name__}: {exc}")))
            return
        parent = multiprocessing.parent_process()
        sentinel = parent.sentinel if parent is not None else None
        loop = EngineCoreLoop(engine, inbox, outbox, sentinel)
        stats = loop.sampler.sample(engine, refresh_kv=True)
        outbox.send(
            encode_event(Ready(engine.model_name, engine.max_model_len, stats, os.getpid()))
        )
        code = loop.run()
    except BaseException:  # noqa: BLE001 - logged here, since sys.exit below replaces it
        logger.exception("engine core loop failed")
        code = EXIT_FAILED
    finally:
        inbox.close(linger=0)
        outbox.close(linger=_LAST_EVENTS_LINGER_MS)
        ctx.term()
        _exit(code)


def _idle_timeout_ms(refresh_at: float | None) -> int | None:
    """How long an idle loop may block in ``poll``: forever, or until ``refresh_at``."""
    if refresh_at is None:
        return None
    return max(0, round((refresh_at - time.monotonic()) * 1000))


def _exit(code: int) -> None:
    """Exits as the interpreter would (wait for non-daemon threads, run atexit handlers: tier
    flushes, multiprocessing's own) but without its module teardown, which takes about a
    second once torch is loaded and has nothing left to release here."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _build_engine(config: EngineConfig, num_threads: int | None) -> LLMEngine:
    if num_threads is not None:
        import torch

        torch.set_num_threads(num_threads)
    from engine.llm_engine import LLMEngine

    # Token ids only: the API process detokenizes (and owns stop strings), so doing it here
    # too would be wasted work on the engine thread.
    return LLMEngine(config, detokenize=False)


def to_core_output(output: RequestOutput) -> CoreOutput:
    m = output.metrics
    first = output.carries_first_token
    return CoreOutput(
        req_id=output.req_id,
        new_token_ids=list(output.new_token_ids),
        finished=output.finished,
        finish_reason=output.finish_reason,
        stop_reason=output.stop_reason,
        num_cached_tokens=output.num_cached_tokens,
        first_token_time=None if m is None else m.first_token_time,
        last_token_time=None if m is None else m.last_token_time,
        finished_time=None if m is None else m.finished_time,
        # Only with the first token: later outputs need not carry it again.
        ttft_breakdown=m.ttft_breakdown if m is not None and first else None,
        num_cached_tokens_by_tier=dict(output.num_cached_tokens_by_tier) if first else None,
        new_logprobs=None
        if output.new_logprobs is None
        else [e.to_plain() for e in output.new_logprobs],
        prompt_logprobs=None
        if output.prompt_logprobs is None or not first
        else [None if e is None else e.to_plain() for e in output.prompt_logprobs],
        queued_time=m.queued_time if m is not None and first else None,
        scheduled_time=m.scheduled_time if m is not None and first else None,
    )


class EngineCoreLoop:
    """Owns the engine and both sockets; ``run`` on the process's only engine thread. The
    engine is closed (offload drained, tiers closed) when ``run`` returns, however it ends."""

    def __init__(
        self,
        engine: LLMEngine,
        inbox: zmq.Socket,
        outbox: zmq.Socket,
        parent_sentinel: int | None,
    ) -> None:
        self.engine = engine
        self._inbox = inbox
        self._outbox = outbox
        self._parent_sentinel = parent_sentinel
        self.sampler = StatsSampler()

    def run(self) -> int:
        """Returns the process exit code: 0 on Shutdown or parent death once the KV drain
        completed, ``EXIT_DRAIN_INCOMPLETE`` if it lost blocks, 1 if a step or the close
        raised."""
        code = EXIT_FAILED
        try:
            code = self._loop()
        finally:
            closed = close_and_judge(self.engine)
        return closed if code == EXIT_OK else code

    def _loop(self) -> int:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        if self._parent_sentinel is not None:
            poller.register(self._parent_sentinel, zmq.POLLIN)
        # Idle: when to resend stats (see below); from the start, so an engine that never
        # served still reports its tiers' health.
        refresh_at: float | None = time.monotonic() + _IDLE_STATS_PERIOD_S
        while True:
            busy = self.engine.has_unfinished_requests()
            timeout_ms = 0 if busy else _idle_timeout_ms(refresh_at)
            events = dict(poller.poll(timeout_ms))
            if not busy and not events and refresh_at is not None:
                # The KV copies an idle save started (write-through) ran meanwhile: one more
                # snapshot, so an idle engine's metrics do not stop before them; later ones
                # carry the tiers' health as the store's prober finds it.
                refresh_at = time.monotonic() + _IDLE_STATS_PERIOD_S
                self._send(StepOutputs([], self.sampler.sample(self.engine, refresh_kv=True)))
                continue
            if self._parent_sentinel is not None and self._parent_sentinel in events:
                logger.warning("API process is gone; engine core drains its KV offload and exits")
                return EXIT_OK
            try:
                if not self._drain_requests():
                    return EXIT_OK
            except ValueError as exc:
                # A request message this core cannot decode (the API and the core disagree: a
                # version mismatch): whichever request it carried would wait for good. Fatal,
                # as a failed step is: the API fails every request and exits.
                logger.error("malformed request message from the API: %s", exc)
                self._send(CoreFailed(f"engine core got a malformed request message: {exc}"))
                return EXIT_FAILED
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fatal: reported, then the process exits
                logger.exception("engine step failed")
                self._send(CoreFailed(f"engine step failed: {type(exc).__name__}: {exc}"))
                return EXIT_FAILED
            # Going idle: no later step would refresh the KV details, so refresh them now.
            idle = not self.engine.has_unfinished_requests()
            stats = self.sampler.sample(self.engine, refresh_kv=idle)
            self._send(StepOutputs([to_core_output(o) for o in outputs], stats))
            if idle:  # after the outputs left: no next step would save the last blocks
                self.engine.save_kv()
                refresh_at = time.monotonic() + _IDLE_STATS_DELAY_S

    def _drain_requests(self) -> bool:
        """Applies every queued request; False once Shutdown arrived. Raises ValueError for a
        message that does not decode."""
        while True:
            try:
                data = self._inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            msg = decode_request(data)  # ValueError: malformed (``_loop``)
            if isinstance(msg, Shutdown):
                return False
            self._apply(msg)

    def _apply(self, msg: CoreRequest) -> None:
        if isinstance(msg, AddRequest):
            try:
                self.engine.add_request(
                    msg.req_id,
                    msg.prompt_token_ids,
                    msg.params,
                    arrival_time=msg.arrival_time,
                    api_times=msg.api_times,
                )
            except Exception as exc:  # noqa: BLE001 - a bad request fails only itself
                self._send(RequestRejected(msg.req_id, str(exc)))
        elif isinstance(msg, AbortRequests):
            for req_id in msg.req_ids:
                self.engine.abort_request(req_id)  # unknown or finished ids are ignored
        elif isinstance(msg, StatsRequest):
            self._send(StepOutputs([], self.sampler.sample(self.engine, refresh_kv=True)))

    def _send(self, event: CoreEvent) -> None:
        self._outbox.send(encode_event(event))
