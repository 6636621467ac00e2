"""OpenAI-shaped error responses and the FastAPI exception handlers that produce them.

Every error body is ``{"error": {"message", "type", "param", "code"}}``. Validation problems
(pydantic, SamplingParams, prompt too long) are 400, never 422 or 500.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core.base import EngineDeadError
from engine.server.protocol import ProtocolError
from engine.server.responses import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised by handlers to return a specific status with an OpenAI-shaped body."""

    def __init__(
        self, status_code: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code


def error_response(
    status_code: int, message: str, *, param: str | None = None, code: str | int | None = None
) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorInfo(
            message=message,
            type=_TYPE_BY_STATUS.get(status_code, "server_error"),
            param=param,
            code=code,
        )
    )
    return JSONResponse(body.model_dump(), status_code=status_code)


def error_body(message: str, error_type: str = "server_error") -> dict[str, object]:
    """The error object sent inside an SSE stream once the 200 status has gone out."""
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type)).model_dump()


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        # FastAPI puts the character offset where a field name would be ("31: JSON decode
        # error", param "31"): say what is wrong and where, and name no field.
        loc = first.get("loc", ())
        at = loc[-1] if len(loc) > 1 and isinstance(loc[-1], int) else None
        reason = (first.get("ctx") or {}).get("error") or first.get("msg", "undecodable")
        where = f" at character {at}" if at is not None else ""
        return f"invalid JSON body: {reason}{where}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if not loc and first.get("type") == "missing":
        return "missing JSON body: expected a JSON object", None
    param = ".".join(loc) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


def _content_type_hint(request: Request, exc: RequestValidationError) -> str | None:
    """The message for a body that is not a JSON object because it was not sent as JSON
    (``curl -d`` without ``-H 'Content-Type: application/json'`` sends a form): FastAPI then
    only says "Input should be a valid dictionary". None for anything else."""
    errors = exc.errors()
    if not errors or tuple(errors[0].get("loc", ())) != ("body",):
        return None
    sent = request.headers.get("content-type", "")
    if "json" in sent.lower():
        return None
    return (
        "expected a JSON object body sent with Content-Type: application/json, "
        f"got Content-Type: {sent or 'none'}"
    )


def install_error_handlers(app: FastAPI) -> None:
    """Mutates ``app``: registers handlers for the exception types the server raises."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status_code, exc.message, param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        hint = _content_type_hint(request, exc)
        if hint:
            message, param = hint, None
        return error_response(400, message, param=param)

    @app.exception_handler(ProtocolError)
    async def _protocol(_: Request, exc: ProtocolError) -> JSONResponse:
        return error_response(400, str(exc), param=exc.param)

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError) -> JSONResponse:
        # The engine raises ValueError for requests it rejects (e.g. a prompt it cannot fit).
        return error_response(400, str(exc))

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {exc!r}")
