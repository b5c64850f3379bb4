"""One timer for a connection's deadlines (protocol/deadline_timer.py), on a real event loop."""

from __future__ import annotations

import asyncio

from pdserve.protocol.deadline_timer import DeadlineTimer


def test_it_fires_by_the_earliest_due_it_was_wound_for_and_once():
    async def main():
        loop = asyncio.get_running_loop()
        fired = []
        timer = DeadlineTimer(loop, lambda: fired.append(loop.time()))
        start = loop.time()
        timer.wind(start + 60)
        timer.wind(None)  # nothing due: nothing changes
        timer.wind(start + 90, None)  # later: the timer already fires first
        timer.wind(None, start + 100)  # so is this one
        timer.wind(start + 120, start + 0.05)  # the earlier one is earlier than the timer: set again
        async with asyncio.timeout(10):
            while not fired:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        return start, fired

    start, fired = asyncio.run(main())
    assert len(fired) == 1 and fired[0] - start < 30  # by the earliest due, not the 60 s one


def test_stopped_it_does_not_fire_and_can_be_wound_again():
    async def main():
        loop = asyncio.get_running_loop()
        fired = []
        timer = DeadlineTimer(loop, lambda: fired.append(1))
        timer.wind(loop.time() + 0.01)
        timer.stop()
        await asyncio.sleep(0.05)
        assert fired == []
        timer.wind(loop.time() + 0.01)
        async with asyncio.timeout(10):
            while not fired:
                await asyncio.sleep(0.01)

    asyncio.run(main())
