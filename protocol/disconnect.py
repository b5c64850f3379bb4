"""Client disconnects before a response starts.

Work done before the status line (the worker waiting for its engine's first output, the router
waiting for a prefill answer) must stop when the client leaves: cancelling it closes upstream
connections and aborts engine requests, so their KV blocks come back now.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from starlette.requests import Request


class ClientGone(Exception):
    """The client disconnected before the response started."""


async def wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable):
    """Await `work`, cancelling it if the client disconnects first (raises ClientGone)."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(wait_for_disconnect(request.receive))
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
