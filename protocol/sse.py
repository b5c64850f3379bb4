"""Server-sent events for OpenAI streams.

Starlette's StreamingResponse notices a gone client only when a write fails (ASGI 2.4) and then
leaves the body iterator suspended for the garbage collector to close. A stream that writes
nothing for a while (a request queued in the engine, a router waiting for a decode worker's
first byte) must still release what it holds now, not at some GC: so `SSEResponse` listens
for `http.disconnect` beside the writer and closes the iterator deterministically in every case.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.protocol.disconnect import wait_for_disconnect

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None] | None = None,
                 headers: dict[str, str] | None = None):
        """`on_close` runs once the response is over, however it ended, even if the iterator
        never started (a generator closed before its first step runs no `finally`)."""
        super().__init__(content, headers={**HEADERS, **headers} if headers else HEADERS)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = asyncio.ensure_future(self.stream_response(send))
        listener = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({writer, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (writer, listener):
                t.cancel()
            await asyncio.gather(writer, listener, return_exceptions=True)
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                if self.on_close is not None:
                    self.on_close()
        if writer.done() and not writer.cancelled() and writer.exception() is not None:
            if not isinstance(writer.exception(), OSError):  # a write to a closed socket is a disconnect
                raise writer.exception()


def when_over(response: Response, fn: Callable[[], None]) -> None:
    """Runs `fn` once `response` is over: an SSE stream's when it ends, however it ended (before
    what its `on_close` already ran), any other response now."""
    if not isinstance(response, SSEResponse):
        fn()
        return
    ended = response.on_close

    def closed() -> None:
        fn()
        if ended is not None:
            ended()

    response.on_close = closed
