"""Tool calls parsed back out of the output, whole or chunk by chunk for a stream.

Tool calls use one text convention, the Hermes / Qwen one: `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` (serving/api/admit.py puts the tools into the prompt and compiles the grammar a forced
tool_choice needs). Here the output is split into content and calls in OpenAI's shapes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from serving.engine.grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


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
