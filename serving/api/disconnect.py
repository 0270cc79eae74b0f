"""Work that stops the moment the client goes away: the generation is cancelled, so its cleanup
(engine abort, KV blocks freed) runs at once instead of at the next failed write."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Run ``work``; if the client disconnects first, cancel it (its cleanup runs) and raise ClientGone."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):  # the client is gone; cleanup ran
            pass
        raise ClientGone
    finally:
        watcher.cancel()
        if not task.done():  # we were cancelled: let the work's own cleanup finish before ours runs
            task.cancel()
            try:
                await asyncio.shield(task)
            except BaseException:  # noqa: BLE001 - cancelled work ends in CancelledError or its own error
                pass
