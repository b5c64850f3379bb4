"""`yield from` for a response's async generators, without a generator step per event.

An async generator cannot `yield from`: one that hands on another's events writes
`async for e in inner: yield e`, and every event then costs a step of each generator on the
way (the router's P/D stream: the hand-off's, `decode_events`' and the relay's, for each relayed
chunk). Instead it yields `YieldFrom(inner)`: the response iterates `inner` itself, and when
`inner` is over resumes the generator as the `async for` would have (its end sent in, or its
exception thrown in at the `yield`), so the generator's own code (its `finally`, what follows
the loop) runs where and when it did.

    async def stream():
        try:
            yield first
            yield YieldFrom(relay())    # relay's events go to the client; then this goes on
        finally:
            up.close()

Closing (a client that hangs up, a write that fails) closes the innermost generator first,
then each one that handed over to it: each `finally` runs in order, now. (An `async for` left
at its `yield` leaves its inner generator to the garbage collector's finaliser.)

`Delegation` is that stack; `SSEResponse` (sse.py) steps its top inline; `flat()` gives the
plain events to any other reader of a response's iterator.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator


class YieldFrom:
    """Yielded by a response's async generator: `async for e in events: yield e`, done by the
    response (module docstring). The generator that yields it is resumed with `events`' end."""

    __slots__ = ("events",)

    def __init__(self, events: AsyncIterator):
        self.events = events


class Delegation:
    """A response's iterator and those it handed over to (`YieldFrom`), innermost last.
    `step` is the innermost's `__anext__`: the reader awaits it for each event and calls
    `settle` with what is not an event (a `YieldFrom`, or what the step raised)."""

    __slots__ = ("_stack", "step")

    def __init__(self, events: AsyncIterator):
        self._stack: list[AsyncIterator] = [events]
        self.step = events.__anext__

    async def settle(self, item: object = None, error: BaseException | None = None) -> object:
        """The next event given the innermost's last outcome: `item` (a `YieldFrom` to follow)
        or `error` (its end, StopAsyncIteration, or its exception): an iterator that ended
        resumes the one that handed over to it with that end, as `async for` would. Raises
        StopAsyncIteration when the outermost ends, or what it raised."""
        stack = self._stack
        try:
            while True:
                if error is None:
                    if not isinstance(item, YieldFrom):
                        self.step = stack[-1].__anext__
                        return item
                    stack.append(item.events)
                    try:
                        item = await item.events.__anext__()
                    except BaseException as e:  # its end or failure, handed to the one below
                        error = e
                    continue
                stack.pop()
                if not stack:
                    raise error
                outer: AsyncGenerator = stack[-1]  # it yielded a YieldFrom: a generator
                try:
                    item = await (outer.asend(None) if isinstance(error, StopAsyncIteration) else outer.athrow(error))
                    error = None
                except BaseException as e:
                    error = e
        finally:
            # The error raised keeps this frame in its traceback: without it, no cycle for the
            # garbage collector to find (one per stream).
            error = item = None

    async def aclose(self) -> None:
        """Close every iterator still open, innermost first, each even if one before it fails;
        the first failure is raised once all are closed."""
        failure = None
        while self._stack:
            events = self._stack.pop()
            try:
                await events.aclose()  # type: ignore[attr-defined]
            except BaseException as e:
                failure = failure or e
        if failure is not None:
            raise failure


async def flat(events: AsyncIterator) -> AsyncIterator:
    """`events` with every `YieldFrom` followed: for a reader of a response's iterator other
    than the response (a stream converted to another API's events)."""
    chain = Delegation(events)
    try:
        while True:
            try:
                item = await chain.step()
            except BaseException as e:
                try:
                    item = await chain.settle(error=e)
                except StopAsyncIteration:
                    return
            else:
                if isinstance(item, YieldFrom):
                    item = await chain.settle(item)
            yield item
    finally:
        await chain.aclose()
