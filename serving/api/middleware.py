"""One pure-ASGI middleware for every request: request id, body size limit, request counter, and
one structured access-log line (request id, key id — never the key —, status, tokens, TTFT, latency)."""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.api.errors import BodyNotUtf8, BodyReadTimeout, BodyTooLarge, error_body
from serving.api.metrics import ServerMetrics

access_log = logging.getLogger("specdeploy.access")

ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/health", "/ready",
                       "/metrics"})
_PROBES = frozenset({"/health", "/ready", "/metrics"})
STATUS_CLIENT_CLOSED = 499  # nginx's convention for "client went away first"


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics, max_body_bytes: int,
                 body_timeout_s: float) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        headers = dict(scope.get("headers") or [])
        request_id = _safe_request_id(headers.get(b"x-request-id")) or uuid.uuid4().hex
        fields: dict[str, Any] = {}
        state = scope.setdefault("state", {})
        state.update(request_id=request_id, received_at=started, log_fields=fields)
        status = 0
        complete = False

        async def send_wrapper(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message = dict(message)
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        try:
            declared = int(headers.get(b"content-length", b"0") or 0)
        except ValueError:
            declared = -1
        try:
            if declared < 0:
                await _send_json(send_wrapper, 400, error_body(
                    400, "Content-Length must be a non-negative integer", code="invalid_http_request"))
            elif declared > self.max_body_bytes:
                await _send_json(send_wrapper, 413, error_body(
                    413, f"request body exceeds {self.max_body_bytes} bytes", code="request_too_large"))
            else:
                await self.app(scope, self._limited(receive), send_wrapper)
        finally:
            if not complete and status in (0, 200):
                status = STATUS_CLIENT_CLOSED
            path = scope.get("path", "")
            endpoint = path if path in ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
            record = {
                "request_id": request_id,
                "key_id": state.get("key_id"),
                "method": scope.get("method"),
                "path": endpoint,
                "status": status,
                **fields,
                "latency_s": round(time.monotonic() - started, 6),
            }
            access_log.log(logging.DEBUG if path in _PROBES else logging.INFO, json.dumps(record))

    def _limited(self, receive: Receive) -> Receive:
        """The body as the app reads it: at most max_body_bytes (chunked too), strict UTF-8 without NUL
        (so no UTF-16 and no surrogates), each part within body_timeout_s of the previous one."""
        received = 0
        limit, timeout = self.max_body_bytes, self.body_timeout_s
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        body_done = False

        async def wrapper() -> Message:
            nonlocal received, body_done
            if body_done:  # after the body only a disconnect can come: no timeout
                return await receive()
            try:
                async with asyncio.timeout(timeout):
                    message = await receive()
            except TimeoutError:
                raise BodyReadTimeout(timeout) from None
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                received += len(chunk)
                if received > limit:
                    raise BodyTooLarge(limit)
                body_done = not message.get("more_body", False)
                if b"\x00" in chunk:
                    raise BodyNotUtf8("NUL byte (UTF-16?)")
                try:
                    decoder.decode(chunk, final=body_done)
                except UnicodeDecodeError as exc:
                    raise BodyNotUtf8(exc.reason) from None
            else:
                body_done = True
            return message

        return wrapper


def _safe_request_id(raw: bytes | None) -> str | None:
    if not raw or len(raw) > 64:
        return None
    text = raw.decode("latin-1")
    return text if all(c.isalnum() or c in "-_." for c in text) else None


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
