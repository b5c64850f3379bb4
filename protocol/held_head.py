"""One write for a response's head and the start of its body.

uvicorn writes a response's head (`http.response.start`) to the socket as soon as it is sent,
then each body part: a unary answer takes two writes, a stream one more than its parts. Each
write is a syscall and, on loopback or a local network, the peer's receive path too, which
made them a sizeable share of the router's CPU per request. `HeldHead` is the transport one
request-response cycle writes through: the head is held until the cycle's next write, which
carries both; if none follows before the event loop's next turn (a stream waiting for its first
part, a HEAD request), the head goes out alone then. Bytes and their order are unchanged.
"""

from __future__ import annotations

import asyncio


class HeldHead:
    __slots__ = ("_transport", "_loop", "_held", "_flush_at", "_first")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._held = b""
        self._flush_at: asyncio.Handle | None = None
        self._first = True

    def write(self, data: bytes) -> None:
        if self._first:  # the head (or a 100 Continue, which then goes out on the loop's next turn)
            self._first = False
            self._held = data
            self._flush_at = self._loop.call_soon(self._flush)
            return
        if self._held:
            data = self._held + data
            self._held = b""
            self._flush_at.cancel()
        self._transport.write(data)

    def _flush(self) -> None:
        held, self._held = self._held, b""
        if held and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)
