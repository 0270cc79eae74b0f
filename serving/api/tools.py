"""Structured outputs and tool calling at the API: what grammar a request needs, the prompt its tools give, and
the tool calls parsed back out of the output (whole, or chunk by chunk for a stream).

Grammars are compiled here, in a worker thread and cached by schema (serving/engine/grammar.py), and handed
to the engine request already compiled: the engine loop never compiles.

Tool calls use one text convention, the Hermes / Qwen one: `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`. A chat template that knows tools (it mentions `tools`) gets them through
`apply_chat_template(..., tools=...)`; any other template gets the documented fallback: a system message that
lists the tools and this format, assistant tool calls written back in the format and tool results as user
messages in `<tool_response>` tags. `tool_choice` "required" or a named function is enforced by a grammar
(one call, of one of the allowed functions, with arguments valid against its parameters); "auto" lets the
model choose and parses whatever calls it writes; "none" leaves the tools out of the prompt.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from serving.api.errors import ApiError
from serving.api.schemas import ChatCompletionRequest, NamedToolChoice, SamplingFields
from serving.engine.grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, GrammarError, GrammarSpec, compiler_for

# ---- grammars ---------------------------------------------------------------------------------------------


def grammar_spec(body: SamplingFields) -> tuple[GrammarSpec, str] | None:
    """The grammar a request's output must follow, and the field that asked for it (None: unconstrained)."""
    if isinstance(body, ChatCompletionRequest) and body.tools and forced_tool_choice(body):
        choice = body.tool_choice
        allowed = [t.function for t in body.tools
                   if not isinstance(choice, NamedToolChoice) or t.function.name == choice.function.name]
        return _spec(lambda: GrammarSpec.tool_call({f.name: f.parameters for f in allowed}), "tools"), "tools"
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec("json_object"), "response_format"
    assert fmt.json_schema is not None
    schema = fmt.json_schema.schema_
    spec = GrammarSpec("json_object") if not schema else _spec(lambda: GrammarSpec.json_schema(schema),
                                                              "response_format")
    return spec, "response_format"


def _spec(make: Any, param: str) -> GrammarSpec:
    try:
        spec: GrammarSpec = make()
    except GrammarError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param, code="invalid_schema") from exc
    return spec


async def compile_grammar(engine: Any, body: SamplingFields) -> Any | None:
    """The request's compiled grammar (None: unconstrained), compiled off the event loop; a schema xgrammar
    cannot compile is a 400 naming the problem."""
    wanted = grammar_spec(body)
    if wanted is None:
        return None
    spec, param = wanted
    if engine.tokenizer is None:
        raise ApiError(400, f"{param}: structured output needs a tokenizer; this model has none", param=param)
    compiler = compiler_for(engine.tokenizer)
    try:
        return await asyncio.to_thread(compiler.compile, spec)
    except GrammarError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param, code="invalid_schema") from exc


def attach_grammar(runs: list[Any], compiled: Any | None) -> None:
    """Every choice's engine request follows the grammar (each gets its own matcher in the engine)."""
    for run in runs:
        run.request.grammar = compiled


# ---- prompts ----------------------------------------------------------------------------------------------


def forced_tool_choice(body: ChatCompletionRequest) -> bool:
    return body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice)


def tools_active(body: ChatCompletionRequest) -> bool:
    """Tools go into the prompt and calls are parsed out of the output (not with tool_choice "none")."""
    return bool(body.tools) and body.tool_choice != "none"


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as chat templates take it: OpenAI's shape, tool call arguments parsed to objects."""
    messages: list[dict[str, Any]] = []
    for m in body.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments_object(c.function.arguments)}}
                for c in m.tool_calls]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        messages.append(message)
    return messages


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments else {}
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"messages: tool call arguments are not JSON: {exc}", param="messages") from exc


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    if not tools_active(body):
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools or []]


def template_knows_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """For a template without tool support: tools described in a system message, calls and results as text."""
    out: list[dict[str, str]] = []
    if tools:
        listing = "\n".join(json.dumps(t["function"], sort_keys=True) for t in tools)
        out.append({"role": "system", "content": (
            "You may call functions. The available functions, one JSON object each:\n" + listing + "\n"
            f'To call one, reply with {TOOL_CALL_OPEN}{{"name": <function name>, "arguments": <arguments '
            f"object>}}{TOOL_CALL_CLOSE}; function results come back in <tool_response></tool_response> tags.")})
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
            continue
        text = m["content"]
        for call in m.get("tool_calls", []):
            payload = json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
            text += f"{TOOL_CALL_OPEN}{payload}{TOOL_CALL_CLOSE}"
        out.append({"role": m["role"], "content": text})
    return out


# ---- parsing ----------------------------------------------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(body: str) -> dict[str, Any] | None:
    """One `<tool_call>` body as an OpenAI tool call (None: not a call, kept as text)."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    return {"id": new_call_id(), "type": "function",
            "function": {"name": data["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content outside the calls, or None when empty; the calls) of a whole output: what a stream of it gives."""
    stream = ToolCallStream()
    content, pieces = stream.feed(text)
    more, last = stream.finish()
    content += more
    calls = [piece.done for piece in pieces + last if piece.done is not None]
    return (content if content.strip() or not calls else None), calls


@dataclass
class CallPiece:
    """A tool call as it streams: the first piece carries its id and name, each piece the next part of its
    arguments' JSON text, the last one (`done`) the whole call in OpenAI's shape."""

    index: int  # the call's place among the output's calls
    arguments: str = ""
    id: str | None = None
    name: str | None = None
    done: dict[str, Any] | None = None


# the start of a call written name first, up to its arguments: from there on the arguments stream
_CALL_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_OBJECT_END = re.compile(r"\s*\}?\s*\Z")  # what may be the end of the call's object, not of its arguments


@dataclass
class ToolCallStream:
    """Splits streamed text into content and tool calls: text is passed on as it comes, except a `<tool_call>`
    block. A call written name first (`{"name": ..., "arguments": ...}`, the convention, and what a forced
    tool_choice's grammar writes) streams: its id and name once they are known, then its arguments piece by
    piece, held back only where they may be the end of the call's object. Any other call is held until it closes
    and then returned whole (its text kept as content if it is not a valid call)."""

    _buffer: str = ""
    _in_call: bool = False
    _call: CallPiece | None = None  # the call streaming now (its header was read)
    _arguments: str = ""  # its arguments so far
    calls_made: int = field(default=0)

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        self._buffer += text
        content, pieces = "", list[CallPiece]()
        while True:
            if not self._in_call:
                start = self._buffer.find(TOOL_CALL_OPEN)
                if start < 0:
                    keep = _partial_suffix(self._buffer, TOOL_CALL_OPEN)  # may be the start of a tag
                    content += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return content, pieces
                content += self._buffer[:start]
                self._buffer = self._buffer[start + len(TOOL_CALL_OPEN):]
                self._in_call = True
            end = self._buffer.find(TOOL_CALL_CLOSE)
            if self._call is None:
                header = _CALL_HEADER.match(self._buffer)
                if header is not None and (end < 0 or header.end() <= end):
                    self._call = CallPiece(self.calls_made, id=new_call_id(), name=json.loads(header.group(1)))
                    self.calls_made += 1
                    self._arguments = ""
                    pieces.append(self._call)
                    self._buffer = self._buffer[header.end():]
                    end = self._buffer.find(TOOL_CALL_CLOSE)
                elif end < 0:
                    return content, pieces  # not known yet to be a streaming call: held until it closes
                else:
                    body, self._buffer = self._buffer[:end], self._buffer[end + len(TOOL_CALL_CLOSE):]
                    self._in_call = False
                    content += self._whole_call(body, pieces)
                    continue
            if end < 0:  # stream what cannot be the end of the call's object or the start of the closing tag
                held = _partial_suffix(self._buffer, TOOL_CALL_CLOSE)
                cut = _OBJECT_END.search(self._buffer[: len(self._buffer) - held])
                assert cut is not None
                self._stream_arguments(self._buffer[: cut.start()], pieces)
                self._buffer = self._buffer[cut.start():]
                return content, pieces
            body, self._buffer = self._buffer[:end], self._buffer[end + len(TOOL_CALL_CLOSE):]
            self._in_call = False
            self._end_call(body, pieces)

    def finish(self) -> tuple[str, list[CallPiece]]:
        """The end of the output: a streaming call ends with what it has; any other unclosed call is parsed if its
        JSON is whole, else returned as text."""
        rest, self._buffer = self._buffer, ""
        if not self._in_call:
            return rest, []
        self._in_call = False
        pieces = list[CallPiece]()
        if self._call is not None:
            self._end_call(rest, pieces)
            return "", pieces
        text = self._whole_call(rest, pieces, closed=False)
        return text, pieces

    def _stream_arguments(self, text: str, pieces: list[CallPiece]) -> None:
        assert self._call is not None
        if not self._arguments:
            text = text.lstrip()
        if text:
            self._arguments += text
            pieces.append(CallPiece(self._call.index, arguments=text))

    def _end_call(self, body: str, pieces: list[CallPiece]) -> None:
        """The streaming call's last text: its arguments end where its object does."""
        assert self._call is not None
        rest = body.rstrip()
        self._stream_arguments(rest[:-1].rstrip() if rest.endswith("}") else rest, pieces)
        done = {"id": self._call.id, "type": "function",
                "function": {"name": self._call.name, "arguments": self._arguments}}
        pieces.append(CallPiece(self._call.index, done=done))
        self._call = None

    def _whole_call(self, body: str, pieces: list[CallPiece], closed: bool = True) -> str:
        """A call not written name first, read whole: its one piece, or its text when it is not a call."""
        call = parse_call(body.strip())
        if call is None:
            return TOOL_CALL_OPEN + body + (TOOL_CALL_CLOSE if closed else "")
        function = call["function"]
        pieces.append(CallPiece(self.calls_made, function["arguments"], call["id"], function["name"], done=call))
        self.calls_made += 1
        return ""


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def assistant_message(body: ChatCompletionRequest, text: str, finish_reason: str | None
                      ) -> tuple[dict[str, Any], str | None]:
    """The whole response's message and finish reason: tool calls parsed out when tools are on."""
    if not tools_active(body):
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = parse_tool_calls(text)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, (
        "tool_calls" if finish_reason == "stop" else finish_reason)


def tool_call_deltas(pieces: list[CallPiece]) -> list[dict[str, Any]]:
    """Streamed calls as OpenAI streams them: the first delta of a call has its index, id, type, name and (maybe
    empty) arguments; the following ones the next piece of its arguments (clients concatenate them by index)."""
    deltas = []
    for piece in pieces:
        if piece.id is not None:
            deltas.append({"index": piece.index, "id": piece.id, "type": "function",
                           "function": {"name": piece.name, "arguments": piece.arguments}})
        elif piece.arguments:
            deltas.append({"index": piece.index, "function": {"arguments": piece.arguments}})
    return deltas
