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
    """Await `work`, cancelling it if the client disconnects first (raises ClientGone).

    `work` runs in the caller's task, which the disconnect listener cancels: a second task for
    `work` and an `asyncio.wait` per request cost the event loop more than the cancellation does."""
    task = asyncio.current_task()
    gone = False

    def on_disconnect(listener: asyncio.Task) -> None:
        nonlocal gone
        if not listener.cancelled() and listener.exception() is None:
            gone = True
            task.cancel()

    listener = asyncio.ensure_future(wait_for_disconnect(request.receive))
    listener.add_done_callback(on_disconnect)
    try:
        result = await work
    except asyncio.CancelledError:
        # Ours unless someone else also cancelled the caller: then theirs goes on.
        if gone and task.uncancel() == 0:
            raise ClientGone() from None
        raise
    finally:
        listener.remove_done_callback(on_disconnect)
        listener.cancel()
    if gone and task.uncancel() == 0:  # `work` absorbed our cancellation, or finished first
        try:
            await asyncio.sleep(0)  # a cancellation still pending is delivered here, and absorbed
        except asyncio.CancelledError:
            pass
    return result
