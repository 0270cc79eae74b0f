"""POST /v1/responses (the Responses API): translated to a chat request, which takes chat's request path."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from serving.api import respond, run
from serving.api.admit import admit_response
from serving.api.deps import EngineDep, StateDep
from serving.api.schemas import ResponsesRequest

router = APIRouter(tags=["responses"])


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request, engine: EngineDep, state: StateDep) -> Response:
    chat, admission = await admit_response(body, request, engine, state)
    choices = run.start(state, engine, admission)
    return await respond.response(request, body, chat, choices, engine.tokenizer)
