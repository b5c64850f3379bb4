"""The flow-control queue in-process (router/flow_control/queue.py): what the HTTP tests of
test_flow_control.py do not reach cheaply: a tenant's concurrency limit, worker saturation,
the queue timeout, a waiter cancelled as its slot is granted, and who gives way in a full queue."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from pdserve.protocol.errors import APIError
from pdserve.router.flow_control import FlowControlConfig, FlowController, Ticket
from pdserve.router.flow_control.metrics import FlowMetrics


def controller(saturated=lambda: False, **kw) -> FlowController:
    return FlowController(FlowControlConfig(**{"max_inflight": 1, **kw}), FlowMetrics(CollectorRegistry()), saturated)


async def granted_order(flow: FlowController, tickets: list[Ticket]) -> list[int]:
    """Queue `tickets` (in order) behind one held slot, then free it: the order they run in,
    each holding its slot until the next is granted."""
    first = await flow.acquire(Ticket(0, "holder", 1))
    order: list[int] = []

    async def one(i: int, t: Ticket) -> None:
        lease = await flow.acquire(t)
        order.append(i)
        await asyncio.sleep(0)
        lease.release()

    tasks = [asyncio.ensure_future(one(i, t)) for i, t in enumerate(tickets)]
    while flow.queued < len(tickets):
        await asyncio.sleep(0)
    first.release()
    await asyncio.gather(*tasks)
    return order


def test_a_tenant_at_its_limit_lets_others_by():
    async def run():
        flow = controller(max_inflight=2, tenant_max_inflight=1)
        held = await flow.acquire(Ticket(0, "a", 1))  # tenant a at its limit, one slot still free
        b_waits = asyncio.ensure_future(flow.acquire(Ticket(0, "a", 1)))
        other = await asyncio.wait_for(flow.acquire(Ticket(0, "b", 1)), 5)
        assert not b_waits.done() and flow.queued == 1
        other.release()
        assert not b_waits.done()  # a free slot, but its tenant is still at its limit
        held.release()
        (await asyncio.wait_for(b_waits, 5)).release()
        assert flow.inflight == 0 and flow.queued == 0

    asyncio.run(run())


def test_a_saturated_pool_holds_the_queue_until_it_has_room():
    async def run():
        full = {"v": True}
        flow = controller(max_inflight=8, saturated=lambda: full["v"])
        waiter = asyncio.ensure_future(flow.acquire(Ticket(0, "t", 1)))
        while flow.queued < 1:
            await asyncio.sleep(0)
        await asyncio.sleep(0.1)
        assert not waiter.done()
        full["v"] = False  # the next scrape shows room
        (await asyncio.wait_for(waiter, 5)).release()

    asyncio.run(run())


def test_a_request_waits_no_longer_than_the_queue_timeout():
    async def run():
        flow = controller(queue_timeout_s=0.2)
        held = await flow.acquire(Ticket(0, "t", 1))
        with pytest.raises(APIError) as e:
            await flow.acquire(Ticket(0, "t", 1))
        assert e.value.status == 429 and e.value.headers["Retry-After"] == "1" and flow.queued == 0
        held.release()

    asyncio.run(run())


def test_a_waiter_cancelled_as_it_is_granted_gives_its_slot_back():
    async def run():
        flow = controller()
        held = await flow.acquire(Ticket(0, "t", 1))
        waiter = asyncio.ensure_future(flow.acquire(Ticket(0, "t", 1)))
        while flow.queued < 1:
            await asyncio.sleep(0)
        held.release()  # grants the waiter's future...
        waiter.cancel()  # ...but its task is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert flow.inflight == 0
        (await asyncio.wait_for(flow.acquire(Ticket(0, "t", 1)), 5)).release()

    asyncio.run(run())


def test_bands_then_least_served_tenant():
    async def run():
        flow = controller(bands=(-1, 0, 1))
        tickets = [Ticket(1, "x", 1), Ticket(0, "x", 1), Ticket(0, "x", 1), Ticket(0, "y", 1), Ticket(-1, "z", 1)]
        assert await granted_order(flow, tickets) == [4, 1, 3, 2, 0]

    asyncio.run(run())


def test_a_full_queue_makes_room_from_the_tenant_with_the_most_waiting():
    """One tenant fills the bound: another tenant's newcomer takes the flooder's newest place
    (429 'displaced' for it) instead of being refused; the flooder's own newcomer is refused."""
    async def run():
        flow = controller(max_queue=3)
        held = await flow.acquire(Ticket(0, "holder", 1))
        noisy = [asyncio.ensure_future(flow.acquire(Ticket(0, "noisy", 1))) for _ in range(3)]
        while flow.queued < 3:
            await asyncio.sleep(0)
        quiet = asyncio.ensure_future(flow.acquire(Ticket(0, "quiet", 1)))
        with pytest.raises(APIError) as e:
            await asyncio.wait_for(noisy[2], 5)
        assert e.value.status == 429 and e.value.code == "displaced"
        assert not quiet.done() and flow.queued == 3
        with pytest.raises(APIError) as e:
            await flow.acquire(Ticket(0, "noisy", 1))  # the flooder's newcomer: its own queue is the longest
        assert e.value.code == "queue_full"
        held.release()
        for f in (noisy[0], quiet, noisy[1]):  # least served first: quiet right after noisy's first
            (await asyncio.wait_for(f, 5)).release()
        assert flow.inflight == 0 and flow.queued == 0

    asyncio.run(run())
