"""GET /metrics: Prometheus text format, engine series refreshed at each scrape."""

from __future__ import annotations

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from serving.api.deps import StateDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    stats = state.engine.stats() if state.engine is not None else None
    state.metrics.refresh(stats, ready=state.readiness()[0])
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
