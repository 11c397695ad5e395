"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, bounded, never a traceback.

`ApiError` is what handlers raise; `install_error_handlers` turns it, pydantic's validation
errors (400, as vLLM answers them), Starlette's HTTP errors (404, 405, ...) and anything unexpected
(500, a fixed message; the traceback goes to the log only) into that shape.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from bridge.messages import bounded

logger = logging.getLogger(__name__)

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowed", 413: "RequestTooLarge", 415: "UnsupportedMediaType",
          422: "BadRequestError", 429: "RateLimitError", 503: "ServiceUnavailableError"}


class ApiError(Exception):
    """An error answered to the client with `status` and an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = bounded(message)
        self.param = None if param is None else bounded(param, 100)
        self.headers = headers


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": bounded(message), "type": _TYPES.get(status, "InternalServerError"),
                      "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{param or 'body'}: {bounded(first.get('msg', 'invalid'), 200)}{more}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, bounded(exc.detail, 200), None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return error_response(500, "internal server error")
