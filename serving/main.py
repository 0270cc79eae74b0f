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
import signal
import time
from collections.abc import AsyncIterator
from types import FrameType

from fastapi import Depends, FastAPI

from serving.api.auth import RateLimiter, authenticate
from serving.api.errors import install_error_handlers
from serving.api.lifecycle import EngineFactory, build_engine, start_serving
from serving.api.metrics import ServerMetrics
from serving.api.middleware import RequestContextMiddleware
from serving.api.routes import chat, completions, health, metrics, models
from serving.api.settings import Settings
from serving.api.state import ServerState

logger = logging.getLogger("specdeploy.server")

# After the drain grace period, how long uvicorn may still wait for open connections.
_CLOSE_CONNECTIONS_S = 3


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
    install_error_handlers(app)
    app.add_middleware(RequestContextMiddleware, metrics=state.metrics,
                       max_body_bytes=settings.config.service.max_body_bytes)

    authenticated = [Depends(authenticate)]
    app.include_router(health.router)
    app.include_router(metrics.router, dependencies=authenticated if settings.config.service.metrics_require_auth
                       else [])
    app.include_router(models.router, dependencies=authenticated)
    app.include_router(completions.router, dependencies=authenticated)
    app.include_router(chat.router, dependencies=authenticated)
    return app


class DrainingServer:
    """A uvicorn server whose first SIGTERM/SIGINT drains instead of closing the socket."""

    def __init__(self, app: FastAPI, settings: Settings) -> None:
        import uvicorn

        self.state: ServerState = app.state.server
        self.grace_s = settings.config.service.drain_grace_s
        config = uvicorn.Config(app, host=settings.config.service.host, port=settings.config.service.port,
                                log_config=None, access_log=False, timeout_graceful_shutdown=_CLOSE_CONNECTIONS_S)
        server = self

        class _Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: FrameType | None) -> None:
                server.on_signal(self, sig)

            async def on_tick(self, counter: int) -> bool:
                server.on_tick(self)
                return await super().on_tick(counter)

        self.server = _Server(config)
        self.deadline: float | None = None

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
        elif time.monotonic() >= self.deadline:
            logger.warning("drain grace period over with %d request(s) in flight: exiting", self.state.inflight)
            server.should_exit = True

    def run(self) -> int:
        self.server.run()
        return 0


def run(settings: Settings, engine_factory: EngineFactory | None = None) -> int:
    return DrainingServer(create_app(settings, engine_factory), settings).run()
