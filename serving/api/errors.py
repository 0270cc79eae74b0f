"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause maps to a 4xx here; a 500 means a bug in the server.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.api.schemas import SCHEMA_ERROR_CODES

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, code=self.code, param=self.param)

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after)))}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())


class BodyTooLarge(Exception):
    """Raised from the ASGI receive wrapper when a body outgrows service.max_body_bytes."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes")
        self.limit = limit


class BodyNotUtf8(Exception):
    """Raised from the ASGI receive wrapper: the body is not strict UTF-8 (UTF-16, lone surrogates, NUL)."""


class BodyReadTimeout(Exception):
    """Raised from the ASGI receive wrapper when the next part of a body does not arrive in time."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"request body not received within {seconds:g}s")


def body_error_response(exc: BaseException) -> JSONResponse | None:
    """The response for a failure of the receive wrapper, raised directly or wrapped by FastAPI's body
    parsing (which turns every exception there into a 400 "error parsing the body")."""
    if isinstance(exc, BodyTooLarge):
        return JSONResponse(error_body(413, str(exc), code="request_too_large"), status_code=413)
    if isinstance(exc, BodyNotUtf8):
        return JSONResponse(error_body(400, f"request body is not valid UTF-8 JSON: {exc}", code="invalid_encoding"),
                            status_code=400)
    if isinstance(exc, BodyReadTimeout):
        return JSONResponse(error_body(408, str(exc), code="body_timeout"), status_code=408,
                            headers={"connection": "close"})
    return None


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None, "invalid_request"
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "parse error")
        return f"request body is not valid JSON: {detail}", None, "invalid_json"
    loc = _request_path(first.get("loc", ()), exc.body, first.get("type") == "missing")
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") in SCHEMA_ERROR_CODES:
        return message, first.get("ctx", {}).get("param", param), str(first["type"])
    if first.get("type") == "missing" and param is None:
        return "request body is missing: send a JSON object", None, "missing_body"
    if first.get("type") == "missing":
        return f"missing required parameter: {param}", param, "missing_required_parameter"
    return f"{param}: {message}" if param else message, param, "invalid_value"


def _request_path(loc: tuple[Any, ...], body: Any, missing: bool) -> list[str]:
    """The part of a pydantic error location that names the request's fields: the location also names the
    members of a union it tried (`literal['none','auto','required']`, a model's class), which are pydantic's, not
    the client's, so it is walked through the body and keeps what the body has (and a missing field's name)."""
    parts = [p for p in loc if p != "body"]
    if not isinstance(body, dict):
        return [str(p) for p in parts]
    path: list[str] = []
    value: Any = body
    for i, part in enumerate(parts):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            value = value[part]
        elif not (missing and i == len(parts) - 1):
            continue  # a union member's tag
        path.append(str(part))
    return path


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _validation_message(exc)
        return JSONResponse(error_body(400, message, code=code, param=param), status_code=400)

    async def _body_error(request: Request, exc: Exception) -> JSONResponse:
        response = body_error_response(exc)
        assert response is not None
        return response

    for body_exc in (BodyTooLarge, BodyNotUtf8, BodyReadTimeout):
        app.add_exception_handler(body_exc, _body_error)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message, code = (str(exc.detail) if exc.detail else "error"), None
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 400:  # FastAPI's "There was an error parsing the body": bad bytes
            wrapped = body_error_response(exc.__cause__) if exc.__cause__ is not None else None
            if wrapped is not None:  # our receive wrapper's error, wrapped by FastAPI: too large, timeout
                return wrapped
            message, code = "request body is not valid UTF-8 JSON", "invalid_body"
        return JSONResponse(error_body(exc.status_code, message, code=code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(UnicodeDecodeError)
    async def _bad_utf8(request: Request, exc: UnicodeDecodeError) -> JSONResponse:
        body = error_body(400, "request body is not valid UTF-8", code="invalid_encoding")
        return JSONResponse(body, status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, "internal server error", code="internal_error"), status_code=500)
