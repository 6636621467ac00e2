"""What the HTTP layer needs from an engine, whichever process runs it.

``EngineClient`` is the contract the endpoints use; ``engine.core.async_engine.AsyncEngine``
(the core on a thread of the API process) and ``engine.core.client.EngineCoreClient`` (the core
in its own process) both satisfy it, on the half they share (``StreamingFrontEnd``: the live
requests and ``generate``'s stream loop). ``OutputStream`` is the per-request mailbox both use
to hand outputs from their background thread to the asyncio consumer; ``StatsSampler`` builds
the stats snapshot both publish.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# An engine ``stats()`` snapshot: numbers at the top level, and possibly nested dicts or lists
# of per-tier rows (the offload connector's); see engine.server.metrics for how they export.
EngineStats = dict[str, Any]


class EngineDeadError(RuntimeError):
    """The engine stopped (a step raised, its process died, or shutdown): no request can make
    progress."""


class EngineStalledError(EngineDeadError):
    """The engine core's process still runs but has sent nothing for longer than its stall
    timeout (a step stuck in a CUDA call or a collective, the process stopped): treated as
    dead, since no request it holds can finish, and killed at shutdown, since it cannot
    drain."""


class EngineClient(Protocol):
    """The engine as the HTTP endpoints see it. Every method may be called from any thread;
    ``generate`` from an asyncio loop."""

    tokenizer: Any
    model_name: str
    max_model_len: int

    @property
    def is_running(self) -> bool: ...
    @property
    def dead_error(self) -> BaseException | None: ...
    def stats(self) -> EngineStats: ...
    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        req_id: str,
        *,
        arrival_time: float | None = None,
        api_times: dict[str, float] | None = None,
    ) -> AsyncIterator[RequestOutput]: ...
    async def abort(self, req_id: str) -> None: ...
    def end_in_flight(self, reason: str) -> int: ...
    def shutdown(self, timeout_s: float = 10.0) -> str | None:
        """Stops the engine and drains its KV offload; None when that completed, else why
        not (one line). Idempotent."""
        ...


@dataclass(slots=True)
class OutputStream:
    """One request's mailbox: items are RequestOutput or an exception to raise. Written from
    the engine's background thread, read by one coroutine on ``loop``."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Thread-safe; a closed loop (client gone at shutdown) drops the item."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass

    @staticmethod
    def put_all(items: list[tuple[OutputStream, RequestOutput | BaseException]]) -> None:
        """``put`` for every ``(stream, item)`` of one engine step, with one wake-up of each
        event loop instead of one per item: every ``call_soon_threadsafe`` writes the loop's
        self-pipe, a system call that hands the GIL to the loop thread and back. Per output on
        the 2-core CPU that cost ~70 us of the output thread's time, so a first token waited
        for the whole batch's hand-offs before its coroutine ran. Outputs that carry their
        request's first token go first, so their coroutines run before the decodes'; the
        rest keep their order."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, Any]]] = {}
        for stream, item in sorted(items, key=lambda si: not _first_token(si[1])):
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_batch, batch)
            except RuntimeError:
                pass  # a closed loop (client gone at shutdown) drops its items

    async def iterate(self, on_abandon: Callable[[], None]) -> AsyncIterator[RequestOutput]:
        """Yields outputs until one has ``finished=True``; raises a queued exception. If the
        consumer stops early (close, cancel), calls ``on_abandon`` (which aborts the request)."""
        finished = False
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already forgot the request
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                on_abandon()


def _first_token(item: RequestOutput | BaseException) -> bool:
    return isinstance(item, RequestOutput) and item.carries_first_token


def _put_batch(batch: list[tuple[OutputStream, Any]]) -> None:
    for stream, item in batch:
        stream.queue.put_nowait(item)


@dataclass(slots=True)
class StreamEntry:
    """A live request as a front end keeps it: its mailbox (a front end may add its own
    per-request state in a subclass)."""

    stream: OutputStream


class StreamingFrontEnd:
    """What both engine front ends share: the live requests (``_entries``, by request id),
    ``generate``'s registration and stream loop, ``abort``, and failing every waiting request
    when the engine stops. A subclass sets ``_lock`` (guarding ``_entries``, ``_dead`` and
    ``_stopping``; re-entrant if the subclass registers while holding it), ``_entries``,
    ``_dead``, ``_stopping`` and ``_stats`` in its ``__init__``, and implements
    ``_abort_nowait``."""

    _lock: AbstractContextManager[Any]
    _entries: dict[str, StreamEntry]
    _dead: BaseException | None
    _stopping: bool
    _stats: EngineStats  # replaced, never mutated

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def stats(self) -> EngineStats:
        """The engine's ``stats()`` as of its last step (a snapshot; safe from any thread)."""
        return self._stats

    async def abort(self, req_id: str) -> None:
        self._abort_nowait(req_id)

    def _abort_nowait(self, req_id: str) -> None:
        """Forget ``req_id`` (if live) and stop it in the engine; any thread, never blocks."""
        raise NotImplementedError

    def _open(self, req_id: str, entry: StreamEntry) -> None:
        """Register a new request. Raises EngineDeadError when the engine is not running,
        ValueError on a request id already live."""
        with self._lock:
            if self._dead is not None or self._stopping:
                raise EngineDeadError(f"engine is not running: {self._dead!r}")
            if req_id in self._entries:
                raise ValueError(f"duplicate request id {req_id!r}")
            self._entries[req_id] = entry

    async def _outputs(self, req_id: str, stream: OutputStream) -> AsyncIterator[RequestOutput]:
        """The registered request's outputs until its last; a consumer that leaves early
        aborts it."""
        async for output in stream.iterate(lambda: self._abort_nowait(req_id)):
            yield output

    def end_in_flight(self, reason: str) -> int:
        """Ends every live request now: the engine aborts it (its blocks are freed) and its
        stream raises ``EngineDeadError(reason)`` (a 503, or an error event on a stream that
        already started). Any thread. Returns how many were live."""
        with self._lock:
            entries = list(self._entries.items())
        for req_id, entry in entries:
            self._abort_nowait(req_id)
            entry.stream.put(EngineDeadError(reason))
        return len(entries)

    def _fail_all(self, error: BaseException) -> None:
        """Every live request's stream raises ``error``; none is live afterwards."""
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
        for entry in entries:
            entry.stream.put(error)


class StatsSampler:
    """Builds the stats snapshot an engine front end publishes after each step: the engine's
    ``stats()`` (flat counters and gauges, fresh every call) plus its ``kv_stats()`` (KV offload
    details: per-tier rows, decisions, cost model) under ``"kv"``, refreshed at most every
    ``kv_interval_s`` because it walks the store's locks. Details that ``stats()`` already has
    as ``kv_<name>_total`` counters are left out of ``"kv"``. A failing ``kv_stats()`` keeps the
    previous details (stats never fail a step). Not thread-safe: the engine's thread only."""

    def __init__(self, kv_interval_s: float = 1.0) -> None:
        self._kv_interval_s = kv_interval_s
        self._kv: dict[str, Any] = {}
        self._kv_at: float | None = None

    def sample(self, engine: Any, *, refresh_kv: bool = False) -> EngineStats:
        """``engine``: an LLMEngine (``stats()``, ``kv_stats()``). Returns a new dict."""
        stats: EngineStats = dict(engine.stats())
        now = time.monotonic()
        if refresh_kv or self._kv_at is None or now - self._kv_at >= self._kv_interval_s:
            self._kv_at = now
            try:
                kv = engine.kv_stats()
            except Exception:  # noqa: BLE001 - metrics must never take the engine down
                logger.exception("kv_stats() failed; keeping the previous KV details")
            else:
                self._kv = {k: v for k, v in kv.items() if f"kv_{k}_total" not in stats}
        if self._kv:
            stats["kv"] = self._kv
        return stats
