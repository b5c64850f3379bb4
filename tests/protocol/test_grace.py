"""protocol/disconnect.py's Grace: a client's hang-up inside a section waits for the section's end
or its period, whichever comes first; any other cancellation acts at once."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.protocol.disconnect import Grace, hang_up


async def _section(grace: Grace, work: asyncio.Event, entered: asyncio.Event) -> str:
    with grace:
        entered.set()
        await work.wait()
    if grace.gone:
        raise asyncio.CancelledError
    return "done"


def test_a_hang_up_outside_a_section_cancels_at_once():
    async def main():
        task = asyncio.ensure_future(asyncio.Event().wait())
        await asyncio.sleep(0)
        hang_up(task)
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_the_section_finishes_its_work_then_the_hang_up_is_delivered():
    async def main():
        work, entered, grace = asyncio.Event(), asyncio.Event(), Grace(3600)
        task = asyncio.ensure_future(_section(grace, work, entered))
        await entered.wait()
        hang_up(task)
        await asyncio.sleep(0)
        assert not task.done() and grace.gone  # deferred: the work goes on
        work.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelling() == 0  # delivered by the section, no cancellation left pending

    asyncio.run(main())


def test_the_period_running_out_cuts_the_work_off():
    async def main():
        entered, grace = asyncio.Event(), Grace(0.0)
        task = asyncio.ensure_future(_section(grace, asyncio.Event(), entered))  # never finishes alone
        await entered.wait()
        hang_up(task)
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_section_without_a_hang_up_is_transparent_and_other_cancellations_act_at_once():
    async def main():
        work, entered = asyncio.Event(), asyncio.Event()
        task = asyncio.ensure_future(_section(Grace(3600), work, entered))
        await entered.wait()
        work.set()
        assert await task == "done"
        entered.clear()
        task = asyncio.ensure_future(_section(Grace(3600), asyncio.Event(), entered))
        await entered.wait()
        task.cancel()  # not a hang-up: a shutdown, a timeout
        with pytest.raises(asyncio.CancelledError):
            await task
        # A later hang-up of a task whose section is over cancels as usual.
        entered.clear()
        task = asyncio.ensure_future(_section(Grace(3600), work, entered))
        await entered.wait()
        assert await task == "done"

    asyncio.run(main())


def test_work_that_fails_after_the_hang_up_ends_as_the_hang_up():
    async def failing(grace: Grace, fail: asyncio.Event, entered: asyncio.Event) -> None:
        with grace:
            entered.set()
            await fail.wait()
            raise ConnectionResetError("the worker went away")

    async def main():
        fail, entered, grace = asyncio.Event(), asyncio.Event(), Grace(3600)
        task = asyncio.ensure_future(failing(grace, fail, entered))
        await entered.wait()
        hang_up(task)
        fail.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Without a hang-up, the failure is the work's own.
        fail, entered = asyncio.Event(), asyncio.Event()
        fail.set()
        with pytest.raises(ConnectionResetError):
            await failing(Grace(3600), fail, entered)

    asyncio.run(main())
