"""GET /health (process and engine loop alive) and GET /ready (fit to take traffic). No auth."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from serving.api.deps import StateDep

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(state: StateDep) -> JSONResponse:
    alive, detail = state.liveness()
    return JSONResponse({"status": "ok" if alive else "dead", "detail": detail}, status_code=200 if alive else 503)


@router.get("/ready")
async def ready(state: StateDep) -> JSONResponse:
    is_ready, reason = state.readiness()
    # Callers read the fields, never the reason's wording: `phase` is the start-up step reached,
    # `failed` says start-up failed for good (the server stays up, never ready; waiting is pointless).
    body = {"status": "ready" if is_ready else "not_ready", "reason": reason, "phase": state.phase,
            "failed": state.failure is not None}
    return JSONResponse(body, status_code=200 if is_ready else 503, headers=None if is_ready else {"Retry-After": "5"})
