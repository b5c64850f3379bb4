"""Client disconnects before a response starts.

Work done before the status line (the worker waiting for its engine's first output, the router
waiting for a prefill answer) must stop when the client leaves: cancelling it closes upstream
connections and aborts engine requests, so their KV blocks come back now.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

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


# The scope key under which pdserve's own HTTP protocol (http_limits.py) gives each request its
# `LostConnection`: where present, a request learns of its client's hang-up from the protocol
# itself; elsewhere (another server, an in-process test client) from a task reading `receive`.
LOST_CONNECTION = "pdserve.lost_connection"


class LostConnection:
    """The hang-up of one request's connection, told by the protocol as it happens
    (`connection_lost` while the response is incomplete): a listener task per watch (two per
    P/D request) cost the event loop a task's creation, two steps and a cancellation each.

    `watch(callback)` runs `callback` once the connection is lost (at once if it already is)
    and returns what `unwatch` takes to restore the previous watcher."""

    __slots__ = ("lost", "_callback")

    def __init__(self) -> None:
        self.lost = False
        self._callback: Callable[[], None] | None = None

    def watch(self, callback: Callable[[], None]) -> Callable[[], None] | None:
        previous, self._callback = self._callback, callback
        if self.lost:
            asyncio.get_running_loop().call_soon(callback)  # as a listener would: on the loop's next turn
        return previous

    def unwatch(self, previous: Callable[[], None] | None) -> None:
        self._callback = previous

    def connection_lost(self) -> None:
        if not self.lost:
            self.lost = True
            if self._callback is not None:
                self._callback()


async def wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class DisconnectWatch:
    """Calls `on_gone` once the client of a request leaves: through the protocol's
    `LostConnection` when the scope has one, else a listener task reading `receive`. `close()`
    stops watching; `on_gone` never runs after it."""

    __slots__ = ("_on_gone", "_lost", "_previous", "_listener")

    def __init__(self, scope, receive, on_gone: Callable[[], None]):
        self._on_gone = on_gone
        self._lost: LostConnection | None = scope.get(LOST_CONNECTION)
        self._listener: asyncio.Future | None = None
        if self._lost is not None:
            self._previous = self._lost.watch(self._fire)
        else:
            self._listener = asyncio.ensure_future(wait_for_disconnect(receive))
            self._listener.add_done_callback(self._listened)

    def _fire(self) -> None:
        if self._on_gone is not None:
            self._on_gone()

    def _listened(self, listener: asyncio.Future) -> None:
        if not listener.cancelled() and listener.exception() is None:
            self._fire()

    def close(self) -> None:
        self._on_gone = None
        if self._lost is not None:
            self._lost.unwatch(self._previous)
        else:
            self._listener.remove_done_callback(self._listened)
            self._listener.cancel()


async def unless_disconnected(request: Request, work: Awaitable):
    """Await `work`, cancelling it if the client disconnects first (raises ClientGone).

    `work` runs in the caller's task, which the disconnect watch cancels: a second task for
    `work` and an `asyncio.wait` per request cost the event loop more than the cancellation does."""
    task = asyncio.current_task()
    gone = False

    def on_disconnect() -> None:
        nonlocal gone
        gone = True
        hang_up(task)

    watch = DisconnectWatch(request.scope, request.receive, on_disconnect)
    try:
        result = await work
    except asyncio.CancelledError:
        # Ours unless someone else also cancelled the caller: then theirs goes on.
        if gone and task.uncancel() == 0:
            raise ClientGone() from None
        raise
    finally:
        watch.close()
    if gone and task.uncancel() == 0:  # `work` absorbed our cancellation, or finished first
        try:
            await asyncio.sleep(0)  # a cancellation still pending is delivered here, and absorbed
        except asyncio.CancelledError:
            pass
    return result
