"""The Responses API (`POST /v1/responses`) as a translation: its request becomes a chat completion request, which
takes the one request path (admission, limits, auth, metrics, grammar, speculation: routes/chat.py start_chat),
and the chat output becomes its output items. Nothing here generates.

    input (a string, or message / function_call / function_call_output items) + instructions → chat messages
    text.format (json_object / json_schema) → response_format;  tools (function) and tool_choice → chat's
    max_output_tokens → max_completion_tokens;  include message.output_text.logprobs + top_logprobs → logprobs

The server keeps nothing: `previous_response_id` and `conversation` (which need a stored response) are refused
with a 400 that says so; send the earlier items in `input` instead.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from serving.api.errors import ApiError
from serving.api.generation import Collected
from serving.api.routes.logprobs import chat_logprobs
from serving.api.schemas import (
    MAX_LOGPROBS,
    SEED_MAX,
    SEED_MIN,
    ApiBody,
    ChatCompletionRequest,
    JsonSchemaFormat,
    RefusingBody,
    check_tool_choice,
)
from serving.api.tools import parse_tool_calls, tools_active

NOTHING_STORED = ("this server stores no responses; send the earlier output items (messages, function_call and "
                  "function_call_output items) in input instead")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class TextPart(ApiBody):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(ApiBody):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(ApiBody):
    type: Literal["function_call"]
    call_id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    arguments: str


class FunctionCallOutputItem(ApiBody):
    type: Literal["function_call_output"]
    call_id: str = Field(..., min_length=1)
    output: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem
_ITEM_TYPES: dict[str, type[ApiBody]] = {"message": InputMessage, "function_call": FunctionCallItem,
                                       "function_call_output": FunctionCallOutputItem}


class FunctionTool(ApiBody):
    type: Literal["function"]
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(JsonSchemaFormat):
    """text.format: chat's json_schema object flattened beside its type, and its schema required."""

    type: Literal["text", "json_object", "json_schema"]
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # type: ignore[assignment]

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("type json_schema needs a schema")
        return self


class TextConfig(ApiBody):
    format: TextFormat | None = None  # verbosity: a hint, ignored


class ResponsesRequest(RefusingBody):
    refused_fields: ClassVar[dict[str, str]] = {
        "previous_response_id": NOTHING_STORED,
        "conversation": NOTHING_STORED,
        "prompt": "stored prompt templates live on OpenAI's platform; send the text in input",
        "background": "background responses need stored responses to poll; this server stores none",
        "moderation": "the server runs no moderation model; moderate the input and output before and after",
        "context_management": "the server does not compact conversations",
    }

    model: str = Field(..., min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    stream: bool | None = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # extensions, as on chat: the seed of the request's draws (docs/server.md), top-k sampling
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    top_k: int | None = Field(None, ge=-1)

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        """Each item by its type (a message may leave it out); an item of another type is refused by name."""
        if not isinstance(value, list):
            return value
        if not value:
            raise ValueError("input is empty")
        items = []
        for i, item in enumerate(value):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind not in _ITEM_TYPES:
                raise ValueError(f"item {i} has type {kind!r}; this server takes message, function_call and "
                                 "function_call_output items (text only)")
            items.append(_ITEM_TYPES[kind].model_validate(item))
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        for tool in value or []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tool type {kind!r} is not supported: the server runs function tools only")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value: Any) -> Any:
        return check_tool_choice(value, '{"type": "function", "name": ...}')

    @field_validator("truncation", mode="before")
    @classmethod
    def _no_truncation(cls, value: Any) -> Any:
        if value == "auto":
            raise ValueError("auto is not supported: the server never drops input; an input over the context "
                             "length is a 400")
        return value

    @field_validator("input")
    @classmethod
    def _some_text(cls, value: str | list[InputItem]) -> str | list[InputItem]:
        if value == "":
            raise ValueError("input is empty")
        return value

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs is not None


# ---- request → chat -------------------------------------------------------------------------------------------

# chat's names for the fields a response request sets (its errors say them the Responses API's way)
_CHAT_PARAMS = {"messages": "input", "prompt": "input", "response_format": "text.format",
                "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens"}
_CHAT_NAME = re.compile(r"\b(" + "|".join(_CHAT_PARAMS) + r")\b")


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request this response is generated by."""
    chat: dict[str, Any] = {
        "model": body.model, "messages": chat_messages(body), "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
        "stream": False, "parallel_tool_calls": body.parallel_tool_calls,
    }
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_,
                                                                          "strict": fmt.strict}}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in body.tools]
    choice = body.tool_choice
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    chat["tool_choice"] = choice
    if body.wants_logprobs:
        chat |= {"logprobs": True, "top_logprobs": body.top_logprobs or 0}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:  # a rule of chat's (e.g. a forced tool_choice with a format): named as sent
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        message = str(first["msg"]).removeprefix("Value error, ")
        named = _CHAT_NAME.search(message)
        param = field or (named.group(1) if named else None)
        raise as_sent(ApiError(400, f"{param}: {message}" if field else message, param=param,
                               code="invalid_value")) from exc


def as_sent(exc: ApiError) -> ApiError:
    """An error of chat's request path with the fields named as a response request calls them."""
    if exc.param not in _CHAT_PARAMS and not _CHAT_NAME.search(exc.message):
        return exc
    return ApiError(exc.status, _CHAT_NAME.sub(lambda m: _CHAT_PARAMS[m.group(1)], exc.message), code=exc.code,
                    param=_CHAT_PARAMS.get(exc.param or "", exc.param), retry_after=exc.retry_after)


def chat_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """instructions first (a system message), then the input: function calls join the assistant message before
    them (or make one), their outputs become tool messages."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for item in body.input:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return messages


# ---- chat output → response -----------------------------------------------------------------------------------


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
    if not tools_active(body):
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

