"""``build_app``: the FastAPI app serving OpenAI-compatible endpoints over an ``EngineClient``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /tokenize``, ``POST /detokenize`` (vLLM's shapes:
``engine.server.tokenization``), ``GET /version``, ``GET /health`` (200 while the engine runs,
with each KV tier's state, ``engine.server.health``; 503 once its thread or process died, or its
core stalled: ``--engine-stall-timeout``), ``GET``/``POST /ping`` (vLLM's: the same status, no
body), ``GET /metrics`` (Prometheus text format). With ``api_key``, every ``/v1/*`` route and
``/tokenize`` / ``/detokenize`` need ``Authorization: Bearer <key>`` (401 otherwise;
``/health``, ``/ping``, ``/metrics`` and ``/version`` stay open for probes). vLLM leaves its two
tokenizer routes open; here they are closed too, since they run the tokenizer (and the chat
template) on caller input, and a client that sends its key everywhere works with both.
``allowed_origins`` turns CORS on; ``chat_template`` replaces the tokenizer's template for
chat completions and ``/tokenize``. The app does not own the engine: whoever built the
engine shuts it down (``kvtier serve`` does, after uvicorn returns).

A request body over ``max_body_bytes`` is refused with 413 before it is parsed: at once when
its Content-Length says so, else as soon as the bytes received pass it (chunked bodies).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.core.base import EngineClient
from engine.server.endpoints import create_chat_completion, create_completion
from engine.server.errors import error_response, install_error_handlers
from engine.server.health import health_body, is_verbose
from engine.server.metrics import CONTENT_TYPE, ServerMetrics
from engine.server.protocol import ChatCompletionRequest, CompletionRequest
from engine.server.responses import ModelCard, ModelList
from engine.server.return_log import ReturnLog
from engine.server.serving import REQUEST_ID_HEADER, ClientDisconnected, ServingContext
from engine.server.tokenization import detokenize, tokenize

logger = logging.getLogger(__name__)

_ENDPOINTS = frozenset(
    (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/ping",
        "/metrics",
        "/version",
        "/tokenize",
        "/detokenize",
    )
)
_KEYED_PATHS = ("/tokenize", "/detokenize")  # keyed besides /v1/*


DEFAULT_MAX_BODY_BYTES = 16 << 20


class _BodyLimit:
    """ASGI middleware refusing request bodies over ``max_bytes`` with 413. Pure ASGI: the
    body is counted as it is received, never buffered here."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = f"request body over the limit of {self.max_bytes} bytes"
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await error_response(413, message)(scope, receive, send)
                return
        received = 0

        async def counted() -> Message:
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_bytes:  # the app's handler turns it into the 413
                    raise HTTPException(413, message)
            return msg

        await self.app(scope, counted, send)


class _ApiKey:
    """ASGI middleware: ``/v1/*``, ``/tokenize`` and ``/detokenize`` requests need
    ``Authorization: Bearer <key>`` (compared in constant time); others pass. CORS preflights (OPTIONS) pass, so that the CORS layer
    outside answers them."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (
            scope["type"] == "http"
            and scope.get("method") != "OPTIONS"
            and (path.startswith("/v1/") or path.rstrip("/") in _KEYED_PATHS)
        ):
            given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self._expected):
                await error_response(
                    401, "a valid API key is required (Authorization: Bearer <key>)"
                )(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _RequestIdHeader:
    """ASGI middleware (``--enable-request-id-headers``, as vLLM's): every HTTP response carries
    ``X-Request-Id``, the request's own header when it has one, else a new uuid."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        name = REQUEST_ID_HEADER.lower().encode()
        given = next((v for k, v in scope.get("headers", ()) if k == name), b"")
        value = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (name, value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class _RequestCounter:
    """ASGI middleware counting HTTP requests by endpoint and response status. Pure ASGI
    (not BaseHTTPMiddleware) so streamed responses pass through untouched."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else "other"  # bounded label cardinality
        status: list[int] = []

        async def send_and_record(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        except ClientDisconnected:
            # The client went away before a response started (nginx's "client closed"): its
            # engine requests are aborted; no traceback in the log for every such client.
            self.metrics.record_request(endpoint, 499)
        except asyncio.CancelledError:
            self.metrics.record_request(endpoint, status[0] if status else 499)
            raise
        except BaseException:
            self.metrics.record_request(endpoint, status[0] if status else 500)
            raise
        else:
            self.metrics.record_request(endpoint, status[0] if status else 500)


def _open_return_log(path: str | None) -> ReturnLog | None:
    if not path:
        return None
    try:
        return ReturnLog(path)
    except OSError as exc:
        logger.warning("cannot write the API's return log %s: %s; going on without it", path, exc)
        return None


def build_app(
    engine: EngineClient,
    served_model_name: str,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    *,
    api_key: str | None = None,
    allowed_origins: tuple[str, ...] = (),
    chat_template: str | None = None,
    model_info: dict[str, Any] | None = None,
    return_log: str | None = None,
    model_aliases: tuple[str, ...] = (),
    vllm_metric_names: bool = False,
    request_id_headers: bool = False,
) -> FastAPI:
    """A new app (with its own metrics registry) serving ``engine`` as ``served_model_name``;
    request bodies over ``max_body_bytes`` get 413; ``api_key``, ``allowed_origins`` and
    ``chat_template`` as the module docstring says; ``model_info`` (path, dtype, layers) is
    shown by ``/health?verbose=1``; ``return_log``: a file for each request's return and
    first-text times (``engine.server.return_log``; ``kvtier serve --request-log`` sets it;
    one that cannot be opened is logged and left out: it never stops the server);
    ``model_aliases``: more names requests may use (``--served-model-name A B``, as vLLM's:
    responses and metrics carry the first); ``vllm_metric_names``: ``/metrics`` also carries
    the families with a vLLM equivalent under vLLM's names (``--vllm-metric-names``);
    ``request_id_headers``: every response carries ``X-Request-Id``
    (``--enable-request-id-headers``)."""
    metrics = ServerMetrics(engine.stats, served_model_name, vllm_names=vllm_metric_names)
    log = _open_return_log(return_log)
    ctx = ServingContext(engine, served_model_name, metrics, chat_template, log, model_aliases)
    names = (served_model_name, *model_aliases)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        ctx.close()

    app = FastAPI(title="kvtier", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.ctx = ctx
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)  # inside the counter: counted
    if api_key:
        app.add_middleware(_ApiKey, api_key=api_key)
    app.add_middleware(_RequestCounter, metrics=metrics)
    if request_id_headers:  # outside the key check and the body limit: 401s and 413s too
        app.add_middleware(_RequestIdHeader)
    if allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["authorization", "content-type"],
        )

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, request, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, request, raw)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [ModelCard(id=name, max_model_len=engine.max_model_len) for name in names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id not in names:
            return error_response(
                404,
                f"The model `{model_id}` does not exist.",
                param="model",
                code="model_not_found",
            )
        card = ModelCard(id=model_id, max_model_len=engine.max_model_len)
        return JSONResponse(card.model_dump())

    @app.post("/tokenize")
    async def tokenize_route(raw: Request) -> JSONResponse:
        return JSONResponse((await tokenize(ctx, raw)).model_dump())

    @app.post("/detokenize")
    async def detokenize_route(raw: Request) -> JSONResponse:
        return JSONResponse((await detokenize(ctx, raw)).model_dump())

    @app.get("/version")
    async def version() -> JSONResponse:
        from engine.cli import package_version

        return JSONResponse({"version": package_version()})

    def engine_down() -> Response | None:
        if engine.is_running:
            return None
        return error_response(503, f"engine is not running: {engine.dead_error!r}")

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's (SageMaker's) liveness probe: 200 with no body while the engine runs."""
        return engine_down() or Response(status_code=200)

    @app.get("/health")
    async def health(verbose: str | None = None) -> Response:
        if (down := engine_down()) is not None:
            return down
        refresh = getattr(engine, "request_stats", None)
        if refresh is not None:  # the core's next snapshot, for the next probe
            refresh()
        model = {
            "name": served_model_name,
            "max_model_len": engine.max_model_len,
            **(model_info or {}),
        }
        return JSONResponse(health_body(engine.stats(), verbose=is_verbose(verbose), model=model))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    return app
