"""Request handling shared by ``/v1/completions`` and ``/v1/chat/completions``: model check,
prompt length and ``max_tokens`` resolution, starting engine requests so that rejections
become HTTP errors before any byte is streamed, merging several prompts' streams, SSE
framing, and client-disconnect cancellation."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from engine.chat_tokens import ChatTokenCache
from engine.core.base import EngineClient
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.server.errors import APIError
from engine.server.logprobs import LogprobFormatter
from engine.server.metrics import RequestTimer, ServerMetrics
from engine.server.protocol import MAX_REQUEST_ID, ProtocolError, SamplingRequest
from engine.server.responses import PromptTokensDetails, UsageInfo
from engine.server.return_log import ReturnLog

T = TypeVar("T")
DONE_LINE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


# The id a client may give its request, as vLLM reads it: this header, else the body's
# ``request_id``.
REQUEST_ID_HEADER = "X-Request-Id"


def given_request_id(raw: Request, request: SamplingRequest) -> str | None:
    """The id the client gave this request: the ``X-Request-Id`` header, else the body's
    ``request_id`` (vLLM's order); None when neither is there or both are empty. A header
    over 256 characters is a 400, as the body field's bound."""
    given = raw.headers.get(REQUEST_ID_HEADER)
    if given and len(given) > MAX_REQUEST_ID:
        raise ProtocolError(f"{REQUEST_ID_HEADER} is longer than {MAX_REQUEST_ID} characters")
    return given or request.request_id or None


def new_request_id(prefix: str, given: str | None = None) -> tuple[str, str]:
    """(the response's ``id``, the base of its engine request ids): ``prefix-given`` where the
    client gave an id (the ``X-Request-Id`` header or the body's ``request_id``, as vLLM), else
    ``prefix-<uuid>``. Clients may reuse an id (retries, a fixed header): the engine ids then get
    a random part of their own, so two requests in flight never share one."""
    if not given:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        return rid, rid
    rid = f"{prefix}-{given}"
    return rid, f"{rid}-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    token_ids: list[int]
    max_tokens: int


@dataclass(slots=True)
class StartedRequest:
    """A request the engine accepted: its first output and the iterator for the rest."""

    index: int
    first: RequestOutput
    rest: AsyncIterator[RequestOutput]
    timer: RequestTimer

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Yields every output (the first included), recording latency metrics."""
        output: RequestOutput | None = self.first
        while output is not None:
            now = time.monotonic()
            self.timer.on_output(output, now)
            self.timer.on_tokens(len(output.new_token_ids), now)
            if output.finished:
                self.timer.on_finished(now)
            yield output
            if output.finished:
                return
            output = await anext(self.rest, None)


class ServingContext:
    """Holds the engine, the served name, metrics and the chat token cache (rendering with
    ``chat_template`` when given, else the tokenizer's template) for the endpoint handlers
    (used from the event-loop thread, but the chat token cache: ``run_tokenizer``'s thread).

    Tokenizing runs on one thread of its own (``run_tokenizer``), not on the event loop: a
    new conversation's ~6K-token history took 6-8 ms to render and tokenize on the H200 host,
    and meanwhile every other stream's chunks waited (the HF fast tokenizer releases the GIL
    while it encodes, so the loop goes on). One thread, so the chat token cache stays
    single-threaded and no two encodes share the tokenizer; the output thread's decodes ran
    beside the loop's encodes before, as they run beside this thread's now."""

    def __init__(
        self,
        engine: EngineClient,
        served_model_name: str,
        metrics: ServerMetrics,
        chat_template: str | None = None,
        return_log: ReturnLog | None = None,
        model_aliases: tuple[str, ...] = (),
    ):
        """``return_log``: each request's ``return`` and ``first_text`` times, by engine
        request id (``engine.server.return_log``); ``model_aliases``: more names a request
        may give as its ``model``."""
        self.engine = engine
        self.return_log = return_log
        self.served_model_name = served_model_name
        self.model_names = frozenset((served_model_name, *model_aliases))
        self.metrics = metrics
        self.chat_tokens = ChatTokenCache(engine.tokenizer, chat_template=chat_template)
        self.logprobs = LogprobFormatter(engine.tokenizer)
        self._tokenizer_thread = cf.ThreadPoolExecutor(1, thread_name_prefix="kvtier-api-tokenize")

    async def run_tokenizer(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the tokenizer thread (what it raises, raised here)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, functools.partial(fn, *args))

    def close(self) -> None:
        """Stops the tokenizer thread (once its queued work ran); closes the return log."""
        self._tokenizer_thread.shutdown(wait=False)
        if self.return_log is not None:
            self.return_log.close()

    def check_model(self, request: Any) -> None:
        """Raises APIError (404) unless ``request.model`` is unset or a served name."""
        if request.model is not None and request.model not in self.model_names:
            raise APIError(
                404,
                f"The model `{request.model}` does not exist.",
                param="model",
                code="model_not_found",
            )

    def too_long(self, at_least: int, param: str) -> ProtocolError:
        """The 400 for a prompt found too long before it was tokenized whole."""
        return ProtocolError(
            f"prompt is at least {at_least} tokens long but this model's maximum context "
            f"length is {self.engine.max_model_len} tokens (prompt plus at least one "
            "generated token)",
            param,
        )

    def prepare(self, request: SamplingRequest, token_ids: list[int]) -> PreparedPrompt:
        """Resolves ``max_tokens``: at most what the context has left after the prompt (an
        explicit budget beyond it is capped there, as vLLM does, and the reply ends with
        ``finish_reason: "length"``). Raises ProtocolError (400) for an empty prompt or one
        that leaves no room for a generated token."""
        max_len = self.engine.max_model_len
        if not token_ids:
            raise ProtocolError("prompt must not be empty", "prompt")
        keep = request.truncate_prompt_tokens
        if keep is not None:  # vLLM's: the prompt's last k tokens (-1: all that fit)
            token_ids = token_ids[-(max_len - 1 if keep == -1 else min(keep, max_len - 1)) :]
        if len(token_ids) >= max_len:
            raise ProtocolError(
                f"prompt is {len(token_ids)} tokens long but this model's maximum context "
                f"length is {max_len} tokens (prompt plus at least one generated token)",
                "prompt" if hasattr(request, "prompt") else "messages",
            )
        requested = request.requested_max_tokens()
        remaining = max_len - len(token_ids)
        # Unset: as much as fits. Set: capped to what fits (vLLM's get_max_tokens); a value
        # below 1 is left for SamplingParams to refuse, naming the field.
        if requested is None:
            max_tokens = remaining
        else:
            max_tokens = min(requested, remaining) if requested >= 1 else requested
        return PreparedPrompt(token_ids, max_tokens)

    async def start(
        self,
        request_id: str,
        prompts: list[PreparedPrompt],
        request: SamplingRequest,
        api_times: dict[str, float] | None = None,
    ) -> list[StartedRequest]:
        """Submits ``request.n`` samples of every prompt (choice ``index = prompt * n + j``)
        and waits for each one's first output, so that a rejected request raises here
        (ValueError -> 400) before a response starts. With ``n > 1`` a prompt's first sample
        is started alone: once it has its first token its prompt blocks are in the prefix
        cache, and the other samples reuse them instead of computing the prompt again (all
        but its last, partial block). On any failure the already started requests are
        aborted. ``api_times``: this process's TTFT phases (``ttft.API_PHASES``), sent along
        for the request log."""
        arrival = time.monotonic()
        n = request.n
        params = [[request.to_sampling_params(p.max_tokens, j) for j in range(n)] for p in prompts]
        started: list[StartedRequest] = []
        try:
            waves = [[(i, 0) for i in range(len(prompts))]]
            if n > 1:
                waves.append([(i, j) for i in range(len(prompts)) for j in range(1, n)])
            for wave in waves:
                started += await self._start_wave(
                    request_id, prompts, params, wave, n, arrival, api_times
                )
        except BaseException:
            for s in started:  # closing an unfinished generator aborts its engine request
                await s.rest.aclose()  # type: ignore[attr-defined]
            raise
        return sorted(started, key=lambda s: s.index)

    async def _start_wave(
        self,
        request_id: str,
        prompts: list[PreparedPrompt],
        params: list[list[SamplingParams]],
        wave: list[tuple[int, int]],
        n: int,
        arrival: float,
        api_times: dict[str, float] | None,
    ) -> list[StartedRequest]:
        iters = [
            self.engine.generate(
                prompts[i].token_ids,
                params[i][j],
                f"{request_id}-{i * n + j}",
                arrival_time=arrival,
                api_times=api_times,
            ).__aiter__()
            for i, j in wave
        ]
        tasks = [asyncio.ensure_future(anext(it)) for it in iters]
        try:
            firsts = await asyncio.gather(*tasks)
        except BaseException:
            # gather does not cancel the siblings; cancelling them closes their generators,
            # whose cleanup aborts the requests in the engine.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [
            StartedRequest(
                i * n + j,
                first,
                it,
                RequestTimer(self.metrics, arrival, f"{request_id}-{i * n + j}", self.return_log),
            )
            for (i, j), first, it in zip(wave, firsts, iters, strict=True)
        ]


def running_usage(output: RequestOutput, count_tokens: bool = True) -> UsageInfo:
    """One choice's usage so far, for a chunk under vLLM's ``continuous_usage_stats``: its
    prompt and the tokens it generated up to this output (none for a chat stream's role
    chunk: ``count_tokens`` False)."""
    prompt = len(output.prompt_token_ids)
    completion = len(output.token_ids) if count_tokens else 0
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def usage_of(finals: list[RequestOutput], n: int = 1) -> UsageInfo:
    """Usage of a response whose choice ``k`` is ``finals[k]`` (``n`` samples per prompt):
    each prompt counts once, with the cached tokens of its first sample (the one that
    computed it); completions count every sample."""
    firsts = finals[::n]
    prompt = sum(len(o.prompt_token_ids) for o in firsts)
    completion = sum(len(o.token_ids) for o in finals)
    by_tier: dict[str, int] = {}
    for o in firsts:
        for tier, count in o.num_cached_tokens_by_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + count
    details = PromptTokensDetails(
        cached_tokens=sum(o.num_cached_tokens for o in firsts),
        kvtier_cached_tokens_by_tier=by_tier,
    )
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=details,
    )


def finish_reason(output: RequestOutput) -> str | None:
    if not output.finished:
        return None
    return output.finish_reason or "stop"


def stop_reason(output: RequestOutput) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string or stop token id that ended the request; None
    for EOS, a length limit or one still running."""
    return output.stop_reason if output.finished else None


async def collect_final(started: StartedRequest) -> RequestOutput:
    """Consumes a request to its end and returns its last output (cumulative text/ids)."""
    last = started.first
    async for output in started.outputs():
        last = output
    return last


async def merge(started: list[StartedRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several requests' outputs as they arrive. Closing the merged iterator
    cancels the pumps, which closes (and so aborts) every unfinished request."""
    if len(started) == 1:
        async for output in started[0].outputs():
            yield started[0].index, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(s: StartedRequest) -> None:
        try:
            async for output in s.outputs():
                queue.put_nowait((s.index, output, None))
            queue.put_nowait((s.index, None, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((s.index, None, exc))

    tasks = [asyncio.create_task(pump(s)) for s in started]
    try:
        remaining = len(tasks)
        while remaining:
            index, output, error = await queue.get()
            if error is not None:
                raise error
            if output is None:
                remaining -= 1
                continue
            yield index, output
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ClientDisconnected(Exception):  # noqa: N818 - named for what happened, as nginx's 499
    """The client went away before its response started: nothing to send, nothing to log
    beyond the count (the ``_RequestCounter`` records it as 499 and ends the request)."""


async def unless_disconnected(raw: Request, work: Awaitable[T]) -> T:
    """Runs ``work``; if the client disconnects first, cancels it (aborting its engine
    requests) and raises ``ClientDisconnected``."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_disconnect(raw.receive))
    try:
        done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        work_task.cancel()
        await asyncio.gather(work_task, return_exceptions=True)
        raise ClientDisconnected("client disconnected")
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()


async def _wait_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
