"""GET /v1/models and /v1/models/{model}."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from serving.api.admit import check_model
from serving.api.deps import StateDep
from serving.api.state import ServerState

router = APIRouter(tags=["models"])
_CREATED = int(time.time())


def _card(state: ServerState) -> dict[str, Any]:
    card: dict[str, Any] = {"id": state.settings.model_name, "object": "model", "created": _CREATED,
                            "owned_by": "specdeploy"}
    if state.engine is not None:
        card["max_model_len"] = min(state.engine.max_model_len, state.settings.config.max_model_len)
    return card


@router.get("/v1/models")
async def list_models(state: StateDep) -> dict[str, Any]:
    return {"object": "list", "data": [_card(state)]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, state: StateDep) -> dict[str, Any]:
    check_model(state, model)
    return _card(state)
