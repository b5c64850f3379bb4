"""A response generator that yields an async generator (protocol/yield_from.py) sends
what `async for e in inner: yield e` would, its own code after the hand-over runs as it would
(with the inner's end, or its exception at the `yield`), and every way a stream ends early (a
hang-up, a failed write) closes the innermost generator first."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.protocol.sse import SSEResponse
from pdserve.protocol.yield_from import flat


class Boom(Exception):
    pass


def _generators(log: list[str], delegate: bool, fail: bool = False, wait: asyncio.Event | None = None):
    """outer ─▶ middle ─▶ inner, each handing on the next's events by yielding it (or by async for)."""

    async def inner():
        try:
            yield b"i1\n\n"
            if wait is not None:
                await wait.wait()
            yield "i2\n\n"  # a str is encoded, as any chunk
            if fail:
                raise Boom()
        finally:
            log.append("inner closed")

    async def empty():
        log.append("empty ran")
        return
        yield

    async def middle():
        try:
            yield b"m1\n\n"
            if delegate:
                yield empty()
                yield inner()
            else:
                async for e in empty():
                    yield e
                async for e in inner():
                    yield e
            log.append("middle after inner")
            yield b"m2\n\n"
        finally:
            log.append("middle closed")

    async def outer():
        try:
            yield b"o1\n\n"
            try:
                if delegate:
                    yield middle()
                else:
                    async for e in middle():
                        yield e
            except Boom:
                log.append("outer caught")
                yield b"error\n\n"
                return
            yield b"o2\n\n"
        finally:
            log.append("outer closed")

    return outer()


async def _serve(events, send_fails_at: int | None = None, hang_up: asyncio.Event | None = None):
    """Run an SSEResponse over `events`; returns (body, error raised, closed)."""
    body, closed = [], []
    disconnect = hang_up or asyncio.Event()

    async def receive():
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body":
            if send_fails_at is not None and len(body) == send_fails_at:
                raise OSError("the client is gone")
            body.append(message["body"])

    response = SSEResponse(events, on_close=lambda: closed.append(True))
    error = None
    try:
        await response({"type": "http", "headers": []}, receive, send)
    except Exception as e:
        error = e
    return b"".join(body), error, closed


@pytest.mark.parametrize("fail", [False, True], ids=["ends", "inner-fails"])
def test_yield_from_sends_and_runs_what_async_for_does(fail):
    got_log, want_log = [], []
    got = asyncio.run(_serve(_generators(got_log, True, fail)))
    want = asyncio.run(_serve(_generators(want_log, False, fail)))
    assert got[0] == want[0]
    assert got[0] == (b"o1\n\nm1\n\ni1\n\ni2\n\nerror\n\n" if fail else b"o1\n\nm1\n\ni1\n\ni2\n\nm2\n\no2\n\n")
    assert got_log == want_log and got[2] == want[2] == [True]
    assert got[1] is want[1] is None


def test_an_error_nobody_catches_leaves_the_response_as_it_would():
    async def inner():
        yield b"a\n\n"
        raise Boom()

    async def outer():
        yield inner()

    body, error, closed = asyncio.run(_serve(outer()))
    assert body == b"a\n\n" and isinstance(error, Boom) and closed == [True]


def test_a_hang_up_mid_stream_ends_every_generator_innermost_first():
    log = []

    async def run():
        wait, gone = asyncio.Event(), asyncio.Event()
        serving = asyncio.ensure_future(_serve(_generators(log, True, wait=wait), hang_up=gone))
        await asyncio.sleep(0.01)  # inner waits for its second event
        gone.set()
        return await serving

    body, error, closed = asyncio.run(run())
    assert body == b"o1\n\nm1\n\ni1\n\n" and error is None and closed == [True]
    assert log == ["empty ran", "inner closed", "middle closed", "outer closed"]


def test_a_failed_write_closes_the_innermost_generator_first():
    log = []
    body, error, closed = asyncio.run(_serve(_generators(log, True), send_fails_at=2))
    assert body == b"o1\n\nm1\n\n" and error is None and closed == [True]
    # (An async for left at its yield would leave the inner one to the garbage collector.)
    assert log == ["empty ran", "inner closed", "middle closed", "outer closed"]


def test_flat_gives_the_events_and_closes_innermost_first():
    async def read(events, most=None):
        out = []
        async for e in events:
            out.append(e)
            if most is not None and len(out) == most:
                break
        await events.aclose()
        return out

    log = []
    assert asyncio.run(read(flat(_generators(log, True)))) == \
        [b"o1\n\n", b"m1\n\n", b"i1\n\n", "i2\n\n", b"m2\n\n", b"o2\n\n"]
    log.clear()
    assert asyncio.run(read(flat(_generators(log, True)), most=3)) == [b"o1\n\n", b"m1\n\n", b"i1\n\n"]
    assert log == ["empty ran", "inner closed", "middle closed", "outer closed"]
