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


# Tasks inside a `Grace` section: a hang-up reaches them only once the section is over or its
# period has run out (`hang_up`).
_graces: dict[asyncio.Task, "Grace"] = {}


def hang_up(task: asyncio.Task) -> None:
    """The client of `task` left: cancel it, now or, inside a `Grace` section, when that ends."""
    grace = _graces.get(task)
    if grace is None:
        task.cancel()
    else:
        grace.hung_up()


class Grace:
    """A section of the current task that a client's hang-up does not cut short at once: work
    whose loss midway would leak something (a prefill answered just as the client left is the
    only record of its pinned KV; a decode call closed before the worker read the request leaves
    that pin to its TTL) goes on for up to `seconds`, in the caller's own task (a task and a
    shield per request would cost the event loop more than this dictionary entry).

        grace = Grace(2.0)
        with grace:
            result = await work()      # cancelled only once the period runs out
        if grace.gone:
            ...undo what result holds...
            raise asyncio.CancelledError  # the hang-up, delivered now

    Only hang-ups are deferred (`hang_up`); any other cancellation of the task acts at once. Work
    that fails after a hang-up leaves the section as the hang-up (CancelledError), not its error.
    Sections do not nest: an inner one would end the outer's deferral."""

    __slots__ = ("seconds", "gone", "_task", "_timer")

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.gone = False  # the client left during the section
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None

    def __enter__(self) -> "Grace":
        self._task = asyncio.current_task()
        _graces[self._task] = self
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _graces.pop(self._task, None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.gone and exc_type is not None and issubclass(exc_type, Exception):
            # The work failed after the client left: what ends the request is the hang-up (a
            # client that left is counted as gone, not as this failure).
            raise asyncio.CancelledError from exc

    def hung_up(self) -> None:
        if not self.gone:
            self.gone = True
            self._timer = asyncio.get_running_loop().call_later(self.seconds, self._expire)

    def _expire(self) -> None:
        self._timer = None
        _graces.pop(self._task, None)
        self._task.cancel()


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
            hang_up(task)

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
