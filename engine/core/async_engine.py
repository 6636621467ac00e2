"""``AsyncEngine``: one ``LLMEngine`` driven by one background thread of the API process.

``kvtier serve`` runs the engine core in its own process (``engine.core.client``); this
in-process variant stays for ``--engine-in-process`` and for tests that reach into the engine
(``.engine``). ``LLMEngine`` is not thread-safe, so every call into it (add, abort, step, stats)
happens on the engine thread. The asyncio side only enqueues commands and reads per-request
queues that the engine thread feeds through ``loop.call_soon_threadsafe``. Both variants
satisfy ``engine.core.base.EngineClient``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from engine.config import EngineConfig
from engine.core.base import (
    EngineDeadError,
    EngineStats,
    OutputStream,
    StatsSampler,
    StreamEntry,
    StreamingFrontEnd,
)
from engine.core.drain import close_and_judge, describe_exit
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "EngineCore", "EngineDeadError"]
logger = logging.getLogger(__name__)


class EngineCore(Protocol):
    """What ``AsyncEngine`` needs from ``engine.llm_engine.LLMEngine``."""

    tokenizer: Any
    model_name: str
    max_model_len: int
    offload: Any  # the KV connector (None without offload): close() drains it

    def add_request(
        self,
        req_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        api_times: dict[str, float] | None = None,
    ) -> None: ...
    def abort_request(self, req_id: str) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> EngineStats: ...
    def kv_stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class _Add:
    req_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float | None
    api_times: dict[str, float] | None = None


@dataclass(frozen=True, slots=True)
class _Abort:
    req_id: str


class AsyncEngine(StreamingFrontEnd):
    """Owns ``engine`` and the thread that drives it; ``start()`` must be called once.

    Thread-safety: every public method may be called from any thread, ``generate`` from an
    asyncio loop. A request-level error (``add_request`` raising ValueError for a bad prompt)
    is raised by that request's ``generate`` only; an error in ``step()`` is fatal: every
    waiting request and every later ``generate`` raises ``EngineDeadError``.
    """

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len
        self._cond = threading.Condition()  # its lock is re-entrant: generate registers in it
        self._lock = self._cond  # StreamingFrontEnd's lock
        self._commands: deque[_Add | _Abort] = deque()  # guarded by _cond
        self._entries: dict[str, StreamEntry] = {}  # guarded by _cond
        self._sampler = StatsSampler()  # used on the engine thread once it runs
        self._stats: EngineStats = self._sampler.sample(engine)  # replaced, never mutated
        self._dead: BaseException | None = None
        self._stopping = False
        self._close_code: int | None = None  # close_and_judge's verdict, once closed
        self._thread = threading.Thread(target=self._run, name="kvtier-engine", daemon=True)

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Builds the LLMEngine (loads the model) and starts the engine thread."""
        from engine.llm_engine import LLMEngine

        async_engine = cls(LLMEngine(config))
        async_engine.start()
        return async_engine

    def start(self) -> None:
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        req_id: str,
        *,
        arrival_time: float | None = None,
        api_times: dict[str, float] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields one RequestOutput per engine step that touched the request, the last one
        with ``finished=True``. Raises ValueError for a rejected request, EngineDeadError if
        the engine stops. Closing or cancelling the iterator early aborts the request."""
        stream = OutputStream(asyncio.get_running_loop())
        with self._cond:
            self._open(req_id, StreamEntry(stream))
            self._commands.append(_Add(req_id, prompt, params, arrival_time, api_times))
            self._cond.notify()
        async for output in self._outputs(req_id, stream):
            yield output

    def _abort_nowait(self, req_id: str) -> None:
        with self._cond:
            if self._entries.pop(req_id, None) is not None:
                self._commands.append(_Abort(req_id))
                self._cond.notify()

    def shutdown(self, timeout_s: float = 10.0) -> str | None:
        """Stops the engine thread after its current step and closes the engine (offload
        drained); waiting requests get EngineDeadError. Returns None when the engine stopped
        as asked and its KV drain completed, else why not (one line). Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        self._fail_all(EngineDeadError("engine shut down"))
        if self._dead is not None:
            return f"the engine failed before shutdown ({self._dead!r})"
        if self._close_code is None:
            return f"the engine thread did not stop within {timeout_s:.0f} s"
        return describe_exit(self._close_code)

    # --- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or self._has_work()):
                        self._cond.wait()
                    if self._stopping:
                        return
                    commands = list(self._commands)
                    self._commands.clear()
                for command in commands:
                    self._apply(command)
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
                # Snapshot before dispatch: a client that sees its output sees stats with it.
                idle = not self.engine.has_unfinished_requests()  # no later step refreshes
                self._stats = self._sampler.sample(self.engine, refresh_kv=idle)
                self._dispatch(outputs)
                if idle and outputs:  # no next step would save the last requests' blocks
                    self.engine.save_kv()
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine for all
            logger.exception("engine thread failed")
            self._dead = exc
            self._fail_all(EngineDeadError(f"engine step failed: {exc!r}"))
        finally:
            self._close_engine()

    def _close_engine(self) -> None:
        # On the engine thread, after its last step: drains offload and closes the tiers.
        self._close_code = close_and_judge(self.engine)

    def _has_work(self) -> bool:
        # Called with _cond held, on the engine thread only (the engine is not thread-safe).
        return self.engine.has_unfinished_requests()

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            try:
                self.engine.abort_request(command.req_id)
            except (KeyError, ValueError):
                pass  # it finished in the same step the client left
            return
        try:
            self.engine.add_request(
                command.req_id,
                command.prompt,
                command.params,
                arrival_time=command.arrival_time,
                api_times=command.api_times,
            )
        except Exception as exc:  # noqa: BLE001 - a bad request fails only itself
            with self._cond:
                entry = self._entries.pop(command.req_id, None)
            if entry is not None:
                entry.stream.put(exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        ready: list[tuple[OutputStream, RequestOutput | BaseException]] = []
        with self._cond:
            for output in outputs:
                if output.finished:
                    entry = self._entries.pop(output.req_id, None)
                else:
                    entry = self._entries.get(output.req_id)
                if entry is not None:
                    ready.append((entry.stream, output))
        OutputStream.put_all(ready)
