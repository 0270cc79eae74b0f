"""POST /v1/responses' answer: the chat output the request was translated to (serving/api/admit.py to_chat) as a
Response object and its output items (a message, function calls), or its typed events."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from serving.api.render.logprobs import chat_logprobs
from serving.api.render.tool_calls import CallPiece, ToolCallStream, parse_tool_calls
from serving.api.run import Choices, Collected, check_finish
from serving.api.schemas import ChatCompletionRequest, ResponsesRequest


def whole(choices: Choices, body: ResponsesRequest, chat: ChatCompletionRequest, tokenizer: Any, created: float,
          results: list[Collected]) -> dict[str, Any]:
    (result,) = results
    return response_object(choices.request_id, body, created, final_status(result.finish_reason),
                           output_items(chat, result, tokenizer), choices.usage, result.finish_reason)


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def message_item(item_id: str, text: str, logprobs: list[dict[str, Any]] | None, status: str = "completed"
                 ) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text, logprobs)] if status == "completed" else []}


def text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
                       ) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(body: ChatCompletionRequest, result: Collected, tokenizer: Any) -> list[dict[str, Any]]:
    """A whole output as items: its text as one message (none when it only called functions), then its calls."""
    logprobs = chat_logprobs(tokenizer, result.logprobs)["content"] if body.logprobs else None
    if not body.tools_active:
        return [message_item(new_item_id("msg"), result.text, logprobs)]
    content, calls = parse_tool_calls(result.text)
    items = [] if content is None else [message_item(new_item_id("msg"), content, logprobs)]
    return items + [function_call_item(new_item_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"])
                    for c in calls]


def response_object(response_id: str, body: ResponsesRequest, created: float, status: str,
                    output: list[dict[str, Any]], usage: dict[str, int] | None, finish_reason: str | None = None
                    ) -> dict[str, Any]:
    """The Response object: the request's settings echoed, the output, the usage (None while in progress)."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" and finish_reason == "length" else None
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    return {
        "id": response_id, "object": "response", "created_at": int(created), "status": status,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "model": body.model, "output": output, "error": None, "incomplete_details": incomplete,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_logprobs": body.top_logprobs,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": body.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt and fmt.type == "json_schema"
                 else {"type": fmt.type if fmt else "text"}},
        "previous_response_id": None, "reasoning": None, "store": False, "truncation": "disabled",
        "metadata": body.metadata or {}, "user": body.user,
        "usage": None if usage is None else {
            "input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]},
    }


def final_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


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


async def events(choices: Choices, body: ResponsesRequest, chat: ChatCompletionRequest, tokenizer: Any,
                 created: float) -> AsyncIterator[dict[str, Any]]:
    """response.created, in_progress, then per item: output_item.added, its deltas and dones, and last
    response.completed (or .incomplete at max_output_tokens) with the whole response."""
    out = _Output()
    response_id = choices.request_id
    yield out.event("response.created", response=response_object(response_id, body, created, "in_progress", [], None))
    yield out.event("response.in_progress",
                    response=response_object(response_id, body, created, "in_progress", [], None))
    parser = ToolCallStream() if chat.tools_active else None
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
