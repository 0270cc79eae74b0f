"""POST /v1/completions (the legacy text completion API)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from serving.api import respond, run
from serving.api.admit import admit_completion
from serving.api.deps import EngineDep, StateDep
from serving.api.schemas import CompletionRequest

router = APIRouter(tags=["completions"])


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request, engine: EngineDep,
                            state: StateDep) -> Response:
    admission = await admit_completion(body, request, engine, state)
    choices = run.start(state, engine, admission)
    return await respond.completion(request, body, choices, admission.prompt_ids, state, engine.tokenizer)
