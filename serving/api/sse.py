"""Server-sent events that stop generating the moment the client goes away.

Starlette's StreamingResponse notices a disconnect only when its next write fails; this response
listens for ``http.disconnect`` while the engine works and cancels the stream at once, so the
generation's cleanup (engine abort, KV blocks freed) runs immediately.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from serving.api.disconnect import ClientGone, until_disconnect

DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any], event: str | None = None) -> bytes:
    """One event; `event` names it (the Responses API's typed events), else it is a plain data line."""
    data = b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
    return b"event: " + event.encode() + b"\n" + data if event else data


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnect(receive, stream())
        except (ClientGone, OSError):
            scope.setdefault("state", {})["disconnected"] = True
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.on_close is not None:
                await self.on_close()
