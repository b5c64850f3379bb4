"""Server-sent events for OpenAI streams, and the disconnect handling around them.

Starlette's StreamingResponse notices a gone client only when a write fails (ASGI 2.4) and then
leaves the body iterator suspended for the garbage collector to close. A request waiting in the
engine's queue writes nothing for a while, and its KV blocks must come back now, not at some GC:
so `SSEResponse` always listens for `http.disconnect` beside the writer and closes the iterator
(which aborts the engine requests) deterministically in every case.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class ClientGone(Exception):
    """The client disconnected before the response started."""


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        writer = asyncio.ensure_future(self.stream_response(send))
        listener = asyncio.ensure_future(listen())
        try:
            await asyncio.wait({writer, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (writer, listener):
                t.cancel()
            await asyncio.gather(writer, listener, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
        if writer.done() and not writer.cancelled() and writer.exception() is not None:
            if not isinstance(writer.exception(), OSError):  # a write to a closed socket is a disconnect
                raise writer.exception()


async def unless_disconnected(request: Request, work: Awaitable):
    """Await `work`, cancelling it if the client disconnects first (raises ClientGone)."""

    async def listen() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(listen())
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, listener, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()
