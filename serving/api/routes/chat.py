"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from serving.api import respond, run
from serving.api.admit import admit_chat
from serving.api.deps import EngineDep, StateDep
from serving.api.schemas import ChatCompletionRequest

router = APIRouter(tags=["chat"])


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, engine: EngineDep,
                                 state: StateDep) -> Response:
    admission = await admit_chat(body, request, engine, state)
    choices = run.start(state, engine, admission)
    return await respond.chat(request, body, choices, engine.tokenizer)
