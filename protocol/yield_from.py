"""`yield from` for a response's async generators, without a generator step per event.

An async generator cannot `yield from`: one that hands on another's events writes
`async for e in inner: yield e`, and every event then costs a step of each generator on the
way (the router's P/D stream: the hand-off's, `decode_events`' and the relay's, for each relayed
chunk). Instead it yields the inner async generator itself: the response iterates it directly,
and once it is over resumes the generator as the `async for` would have (its end sent in, or
its exception thrown in at the `yield`), so the generator's own code (its `finally`, what
follows the loop) runs where and when it did.

    async def stream():
        try:
            yield first
            yield relay()     # an async generator: relay's events go to the client; then this goes on
        finally:
            up.close()

Closing (a client that hangs up, a write that fails) closes the innermost generator first,
then each one that handed over to it: each `finally` runs in order, now. (An `async for` left
at its `yield` leaves its inner generator to the garbage collector's finaliser.)

A chunk is bytes (or str); an async generator is never one, so yielding one is unambiguous.
`Delegation` is the stack of them; `SSEResponse` (sse.py) awaits its innermost's steps inline
(pushing and popping there: no call per hand-over); `flat()` gives the plain events to any
other reader of a response's iterator.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from types import AsyncGeneratorType
from typing import Union

# A response's iterator: its chunks, and the async generators it hands over to.
Events = AsyncIterator[Union[bytes, AsyncGenerator]]


class Delegation(list):
    """A response's iterator and the async generators it handed over to, innermost last (a
    list: made in C, pushed and popped by the reader inline). `thrown` and `aclose` are what an
    `async for` chain does on a failure and on a close."""

    __slots__ = ()

    async def thrown(self, error: BaseException) -> object:
        """The innermost failed with `error`: thrown into the one that handed over to it at its
        `yield` (as out of its `async for`), and so on down while each lets it through; what the
        first to go on yields next. Raises `error` when none catches it, StopAsyncIteration when
        the one that does then ends and none is left to go on."""
        try:
            while True:
                self.pop()
                if not self:
                    raise error
                outer: AsyncGenerator = self[-1]  # it yielded one: a generator
                try:
                    return await (outer.asend(None) if isinstance(error, StopAsyncIteration) else outer.athrow(error))
                except BaseException as e:
                    error = e
        finally:
            # The error raised keeps this frame in its traceback: without it, no cycle for the
            # garbage collector to find.
            error = None  # noqa: F841

    async def aclose(self) -> None:
        """Close every iterator still open, innermost first, each even if one before it fails;
        the first failure is raised once all are closed."""
        failure = None
        while self:
            events = self.pop()
            try:
                await events.aclose()  # type: ignore[attr-defined]
            except BaseException as e:
                failure = failure or e
        if failure is not None:
            raise failure


async def flat(events: AsyncIterator) -> AsyncIterator:
    """`events` with every hand-over followed: for a reader of a response's iterator other than
    the response (a stream converted to another API's events)."""
    chain = Delegation((events,))
    it = events
    try:
        while True:
            try:
                item = await anext(it)
            except StopAsyncIteration:
                chain.pop()
                if not chain:
                    return
                it = chain[-1]
                continue
            except BaseException as e:
                try:
                    item = await chain.thrown(e)
                except StopAsyncIteration:
                    return
                it = chain[-1]
            if isinstance(item, AsyncGeneratorType):
                chain.append(item)
                it = item
                continue
            yield item
    finally:
        await chain.aclose()
