"""The server process: ``create_app`` builds the FastAPI app (lifespan, middleware, routers) and
``run`` serves it with a uvicorn server that drains on SIGTERM.

Drain: the first SIGTERM (or Ctrl-C) turns /ready to 503 and refuses new work with 503 while the
socket stays open; in-flight requests finish (up to ``service.drain_grace_s``), then the process
exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import time
from collections.abc import AsyncIterator
from types import FrameType

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from serving.api.auth import RateLimiter, authenticate
from serving.api.connections import ConnectionGuard, protocol_class
from serving.api.errors import install_error_handlers
from serving.api.lifecycle import EngineFactory, build_engine, start_serving
from serving.api.metrics import ServerMetrics
from serving.api.middleware import RequestContextMiddleware
from serving.api.routes import chat, completions, health, metrics, models, responses
from serving.api.settings import Settings
from serving.api.state import ServerState

logger = logging.getLogger("specdeploy.server")

# After the drain grace period the running generations are aborted (streams get an error event and a
# clean end, others a 503 body); this long they have to send it before the process exits.
_ABORT_FLUSH_S = 0.5
# Then how long uvicorn may still wait for open connections (an int: uvicorn's setting).
_CLOSE_CONNECTIONS_S = 0


def create_app(settings: Settings, engine_factory: EngineFactory | None = None) -> FastAPI:
    state = ServerState(settings=settings, metrics=ServerMetrics(speculative=settings.config.speculative.enabled))
    factory = engine_factory or build_engine

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        startup = asyncio.create_task(start_serving(state, factory))
        try:
            yield
        finally:
            startup.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await startup
            if state.engine is not None:
                await state.engine.stop()

    app = FastAPI(title="specdeploy", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = state
    app.state.rate_limiter = RateLimiter()
    service = settings.config.service
    app.state.connections = ConnectionGuard(service)
    install_error_handlers(app)
    app.add_middleware(RequestContextMiddleware, metrics=state.metrics, max_body_bytes=service.max_body_bytes,
                       body_timeout_s=service.body_timeout_s)

    authenticated = [Depends(authenticate)]
    app.include_router(health.router)
    app.include_router(metrics.router, dependencies=authenticated if settings.config.service.metrics_require_auth
                       else [])
    app.include_router(models.router, dependencies=authenticated)
    app.include_router(completions.router, dependencies=authenticated)
    app.include_router(chat.router, dependencies=authenticated)
    app.include_router(responses.router, dependencies=authenticated)

    @app.get("/openapi.json", include_in_schema=False, dependencies=authenticated)
    async def openapi(request: Request) -> JSONResponse:
        return JSONResponse(openapi_schema(app))

    return app


def openapi_schema(app: FastAPI) -> dict[str, object]:
    """FastAPI's schema with the server's real error contract: a 400 in OpenAI's error shape where FastAPI
    documents a 422 (the server never sends 422)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = app.openapi()
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["OpenAIError"] = {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
    }
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}}}
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if "requestBody" in operation:
                responses["400"] = {"description": "invalid request", **error}
                responses["413"] = {"description": "request body too large", **error}
                responses["429"] = {"description": "queue full or rate limited", **error}
                responses["503"] = {"description": "not ready, draining or overloaded", **error}
            responses["401"] = {"description": "missing or invalid API key", **error}
    app.openapi_schema = schema
    return schema


class DrainingServer:
    """A uvicorn server whose first SIGTERM/SIGINT drains instead of closing the socket."""

    def __init__(self, app: FastAPI, settings: Settings) -> None:
        import uvicorn

        self.state: ServerState = app.state.server
        self.grace_s = settings.config.service.drain_grace_s
        guard: ConnectionGuard = app.state.connections
        config = uvicorn.Config(app, host=settings.config.service.host, port=settings.config.service.port,
                                log_config=None, access_log=False, timeout_graceful_shutdown=_CLOSE_CONNECTIONS_S,
                                timeout_keep_alive=math.ceil(settings.config.service.keep_alive_s),
                                http=protocol_class(guard), h11_max_incomplete_event_size=64 * 1024)
        server = self

        class _Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: FrameType | None) -> None:
                server.on_signal(self, sig)

            async def on_tick(self, counter: int) -> bool:
                server.on_tick(self)
                return await super().on_tick(counter)

        self.server = _Server(config)
        self.deadline: float | None = None
        self.abort_started: float | None = None
        self._aborting: asyncio.Future[None] | None = None

    def on_signal(self, server: object, sig: int) -> None:
        import uvicorn

        assert isinstance(server, uvicorn.Server)
        if self.state.draining:  # a second signal: stop waiting
            server.should_exit = True
            server.force_exit = sig == signal.SIGINT
            return
        self.state.draining = True
        self.deadline = time.monotonic() + self.grace_s
        logger.info("signal %d: draining %d in-flight request(s), grace %.0fs", sig, self.state.inflight, self.grace_s)

    def on_tick(self, server: object) -> None:
        import uvicorn

        assert isinstance(server, uvicorn.Server)
        if self.deadline is None or server.should_exit:
            return
        if self.state.inflight == 0:
            logger.info("drained: exiting")
            server.should_exit = True
        elif self.abort_started is None and time.monotonic() >= self.deadline:
            logger.warning("drain grace period over with %d request(s) in flight: aborting them", self.state.inflight)
            self.abort_started = time.monotonic()
            self._aborting = asyncio.ensure_future(self.state.abort_all())
        elif self.abort_started is not None and time.monotonic() >= self.abort_started + _ABORT_FLUSH_S:
            logger.warning("exiting with %d request(s) still in flight", self.state.inflight)
            server.should_exit = True

    def run(self) -> int:
        self.server.run()
        return 0


def run(settings: Settings, engine_factory: EngineFactory | None = None) -> int:
    return DrainingServer(create_app(settings, engine_factory), settings).run()
