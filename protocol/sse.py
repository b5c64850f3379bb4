"""Server-sent events for OpenAI streams.

Starlette's StreamingResponse notices a gone client only when a write fails (ASGI 2.4) and then
leaves the body iterator suspended for the garbage collector to close. A stream that writes
nothing for a while (a request queued in the engine, a router waiting for a decode worker's
first byte) must still release what it holds now, not at some GC: so `SSEResponse` watches for
the client's hang-up beside the writer (protocol/disconnect.py `DisconnectWatch`: told by the
server's protocol, or a listener reading `http.disconnect`) and closes the iterator
deterministically in every case.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from types import AsyncGeneratorType

from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.protocol.disconnect import DisconnectWatch, hang_up
from pdserve.protocol.yield_from import Delegation, Events

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_BYTES = (bytes, memoryview)


def event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: Events, on_close: Callable[[], None] | None = None,
                 headers: dict[str, str] | None = None, coalesce: bool = False,
                 on_chunk: Callable[[bytes], None] | None = None):
        """`on_close` runs once the response is over, however it ended, even if the iterator
        never started (a generator closed before its first step runs no `finally`).

        `content` may yield an async generator: its events are then iterated here, with no step
        of the generator that yielded it per event, and it is closed before that one
        (protocol/yield_from.py).

        `on_chunk` sees each chunk as the iterator gives it, before it is sent (or held): what a
        wrapping generator would do per chunk, without a generator's step per chunk.

        `coalesce`: fewer writes (each is a syscall and, on loopback, the peer's receive too).
        The head is sent with the first chunk, not before it (with held_head.py's transport, one
        write for both); a chunk that ends with `[DONE]` is sent with the body's end, once the
        iterator is over (or on its own if the iterator yields anything more). For iterators
        that yield soon and end right after their `[DONE]`: a relay of a worker's stream."""
        if headers or not isinstance(content, AsyncGeneratorType) or type(self) is not SSEResponse:
            super().__init__(content, headers={**HEADERS, **headers} if headers else HEADERS)
        else:  # what Starlette's init makes of this, its headers made once (every stream's case)
            self.body_iterator = content
            self.status_code = 200
            self.background = None
            self.raw_headers = list(_DEFAULT_RAW_HEADERS)
        self.on_close = on_close
        self.coalesce = coalesce
        self.on_chunk = on_chunk

    async def stream_response(self, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        if not self.coalesce:
            await send(start)
            start = None
        held = b""
        on_chunk = self.on_chunk
        chain = self._chain
        it = chain[-1]  # the innermost iterator, stepped here: no generator between
        while True:
            try:
                chunk = await anext(it)
            except StopAsyncIteration:  # the innermost ended: the one that handed over to it goes on
                chain.pop()
                if not chain:
                    break
                it = chain[-1]
                continue
            except BaseException as e:  # the innermost failed: thrown into the one that handed over
                try:
                    chunk = await chain.thrown(e)
                except StopAsyncIteration:
                    break
                it = chain[-1]
            if not isinstance(chunk, _BYTES):
                if isinstance(chunk, AsyncGeneratorType):  # a hand-over (yield_from.py)
                    chain.append(chunk)
                    it = chunk
                    continue
                chunk = chunk.encode(self.charset)
            if on_chunk is not None:
                on_chunk(chunk)
            if self.coalesce and chunk.endswith(DONE) and not held:
                held = chunk
                continue
            if start is not None:
                await send(start)
                start = None
            if held:
                await send({"type": "http.response.body", "body": held, "more_body": True})
                held = b""
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if start is not None:
            await send(start)
        await send({"type": "http.response.body", "body": held, "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The body is written in this task; the watch cancels it when the client leaves (a
        # writer task and an asyncio.wait per stream cost the event loop more).
        task = asyncio.current_task()
        gone = False

        def on_disconnect() -> None:
            nonlocal gone
            gone = True
            hang_up(task)

        self._chain = Delegation((self.body_iterator,))
        watch = DisconnectWatch(scope, receive, on_disconnect)
        try:
            try:
                await self.stream_response(send)
            except asyncio.CancelledError:
                # Ours unless someone else also cancelled this task: then theirs goes on.
                ours, gone = gone, False  # delivered: nothing left to absorb below
                if not ours or task.uncancel() > 0:
                    raise
            except OSError:  # a write to a closed socket is a disconnect
                pass
        finally:
            watch.close()
            try:
                if gone and task.uncancel() == 0:  # the client left as the body ended: absorb it
                    try:
                        await asyncio.sleep(0)
                    except asyncio.CancelledError:
                        pass
                await self._chain.aclose()  # the innermost first (yield_from.py)
            finally:
                if self.on_close is not None:
                    self.on_close()


# An SSEResponse's headers as Starlette makes them from HEADERS and the media type (names
# lowercased, the charset added), for the responses that take nothing else.
_DEFAULT_RAW_HEADERS = tuple(
    StreamingResponse(iter(()), headers=HEADERS, media_type=SSEResponse.media_type).raw_headers)


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
