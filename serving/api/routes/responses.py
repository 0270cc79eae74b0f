"""POST /v1/responses (the Responses API): translated to a chat request and run through chat's request path
(serving/api/responses.py says how); here only the answer's shape: a Response object, or its typed events."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from serving.api.choices import Choices
from serving.api.deps import EngineDep, StateDep
from serving.api.errors import ApiError
from serving.api.generation import Collected, check_finish, respond
from serving.api.responses import (
    ResponsesRequest,
    as_sent,
    final_status,
    function_call_item,
    message_item,
    new_item_id,
    output_items,
    response_object,
    text_part,
    to_chat,
)
from serving.api.routes.chat import start_chat
from serving.api.routes.logprobs import chat_logprobs
from serving.api.schemas import ChatCompletionRequest
from serving.api.tools import CallPiece, ToolCallStream, tools_active

router = APIRouter(tags=["responses"])


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request, engine: EngineDep, state: StateDep) -> Response:
    chat = to_chat(body)
    try:
        choices = await start_chat(chat, request, engine, state, "resp")
    except ApiError as exc:  # its limits and checks, in the words of this API
        raise as_sent(exc) from exc
    created = time.time()

    def whole(results: list[Collected]) -> dict[str, Any]:
        (result,) = results
        return response_object(choices.request_id, body, created, final_status(result.finish_reason),
                               output_items(chat, result, engine.tokenizer), choices.usage, result.finish_reason)

    stream = _events(choices, body, chat, engine.tokenizer, created) if body.stream else None
    return await respond(request, choices, stream, whole, typed_events=True)


@dataclass
class _Output:
    """The items of a streamed response as they are written: a message (opened by its first text), function
    calls (opened by their name), each with its place in the output."""

    items: dict[int, dict[str, Any]] = field(default_factory=dict)  # output index -> the item, as it stands
    message: int | None = None  # the message's output index, once opened
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    calls: dict[int, int] = field(default_factory=dict)  # call index -> output index
    sequence: int = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def open_message(self) -> list[dict[str, Any]]:
        self.message = len(self.items)
        item = self.items[self.message] = message_item(new_item_id("msg"), "", None, status="in_progress")
        return [self.event("response.output_item.added", output_index=self.message, item=item),
                self.event("response.content_part.added", item_id=item["id"], output_index=self.message,
                           content_index=0, part=text_part("", None))]

    def add_text(self, text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        assert self.message is not None
        self.text += text
        self.logprobs += logprobs
        return self.event("response.output_text.delta", item_id=self.items[self.message]["id"],
                          output_index=self.message, content_index=0, delta=text, logprobs=logprobs)

    def close_message(self) -> list[dict[str, Any]]:
        assert self.message is not None
        index, part = self.message, text_part(self.text, self.logprobs)
        item = self.items[index] = {**self.items[index], "status": "completed", "content": [part]}
        where = {"item_id": item["id"], "output_index": index}
        return [self.event("response.output_text.done", **where, content_index=0, text=self.text,
                           logprobs=self.logprobs),
                self.event("response.content_part.done", **where, content_index=0, part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def call_piece(self, piece: CallPiece) -> list[dict[str, Any]]:
        events = []
        if piece.id is not None and piece.name is not None:
            self.calls[piece.index] = index = len(self.items)
            item = self.items[index] = function_call_item(new_item_id("fc"), piece.id, piece.name, "",
                                                          status="in_progress")
            events.append(self.event("response.output_item.added", output_index=index, item=item))
        index = self.calls[piece.index]
        item = self.items[index]
        if piece.arguments:
            item["arguments"] += piece.arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=index, delta=piece.arguments))
        if piece.done is not None:
            item = self.items[index] = {**item, "arguments": piece.done["function"]["arguments"],
                                        "status": "completed"}
            events += [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"]),
                       self.event("response.output_item.done", output_index=index, item=item)]
        return events


async def _events(choices: Choices, body: ResponsesRequest, chat: ChatCompletionRequest, tokenizer: Any,
                  created: float) -> AsyncIterator[dict[str, Any]]:
    """response.created, in_progress, then per item: output_item.added, its deltas and dones, and last
    response.completed (or .incomplete at max_output_tokens) with the whole response."""
    out = _Output()
    response_id = choices.request_id
    yield out.event("response.created", response=response_object(response_id, body, created, "in_progress", [], None))
    yield out.event("response.in_progress",
                    response=response_object(response_id, body, created, "in_progress", [], None))
    parser = ToolCallStream() if tools_active(chat) else None
    held = ""  # with tools, whitespace before any item: a message only if more text follows, or nothing else does
    finish_reason: str | None = None
    async for _, output in choices.outputs():
        check_finish(output)
        text, pieces = output.new_text, list[CallPiece]()
        if parser is not None:
            text, pieces = parser.feed(text)
            if output.finished:
                more, last = parser.finish()
                text, pieces = text + more, pieces + last
        logprobs = chat_logprobs(tokenizer, output.logprobs or [])["content"] if chat.logprobs else []
        if out.message is None and parser is not None and not (held + text).strip() and not logprobs:
            held += text
        elif text or logprobs:
            if out.message is None:
                for event in out.open_message():
                    yield event
            yield out.add_text(held + text, logprobs)
            held = ""
        for piece in pieces:
            for event in out.call_piece(piece):
                yield event
        if output.finished:
            finish_reason = output.finish_reason
    if out.message is None and not out.calls:  # nothing at all was written: one empty message, as a whole answer
        for event in out.open_message():
            yield event
        if held:
            yield out.add_text(held, [])
    if out.message is not None:
        for event in out.close_message():
            yield event
    status = final_status(finish_reason)
    final = response_object(response_id, body, created, status, [out.items[i] for i in sorted(out.items)],
                             choices.usage, finish_reason)
    yield out.event(f"response.{status}", response=final)
