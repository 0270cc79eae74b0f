"""Dependencies as ``Annotated`` aliases, so route signatures read like sentences."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from serving.api.errors import ApiError
from serving.api.state import Engine, ServerState


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


def get_ready_engine(request: Request) -> Engine:
    """The engine, if the server takes traffic now; else 503 with the reason and a Retry-After."""
    state = get_state(request)
    ready, reason = state.readiness()
    if not ready or state.engine is None:
        raise ApiError(503, reason, code="not_ready" if not state.draining else "draining", retry_after=5)
    return state.engine


StateDep = Annotated[ServerState, Depends(get_state)]
EngineDep = Annotated[Engine, Depends(get_ready_engine)]
