"""The after-prefill hand-off (`--pd-handoff after-prefill`, and any prefill worker that answers
whole): the prefill has answered, its KV pinned; the decode call gets the final params.

    prefill answer ── first token ended the request? ──▶ it is the whole answer
         │
         ▼ decode (the client's request + the prefill's kv_transfer_params)
    stream:     the first token's events at once, then the decode stream
    non-stream: the first token's text + the decode text, the decode worker's usage

Until a decode worker may hold the params, the pin is the router's to release (PinnedKV).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from starlette.responses import Response

from pdserve.protocol.contract import PATHS, ROLE_DECODE
from pdserve.protocol.disconnect import Grace
from pdserve.protocol.errors import APIError
from pdserve.protocol.yield_from import Events
from pdserve.router.http1 import UpstreamResponse
from pdserve.router.call import Call, PinnedKV
from pdserve.router.handoff import HANDOFF_GRACE_S, Handoff
from pdserve.router.migration import first_token_id
from pdserve.router.splice import Answer, first_token_ended, first_token_events
from pdserve.router.upstream import Limits
from pdserve.router.upstream_call import UpstreamCall
from pdserve.router.workers import Worker


@dataclass(frozen=True)
class Prefilled:
    """A prefill worker's whole answer: its first token, and the params naming its pinned KV."""

    worker: Worker
    answer: Answer


class AfterPrefill(Handoff[Prefilled]):
    async def run(self, call: Call, prefill: Prefilled) -> Response:
        o, answer = self.o, prefill.answer
        if first_token_ended(answer):
            return o.finished_by_prefill(call, answer)
        call.disaggregated = True
        pin = PinnedKV(prefill.worker, answer.kv_transfer_params)
        if call.stream:
            return o.stream_response(call, self.stream(call, answer, pin), pin=pin)
        try:
            return await self._unary(call, self.decode_pool(call, pin), answer, pin)
        finally:
            pin.abandon(o.up)

    def decode_pool(self, call: Call, pin: PinnedKV) -> list[Worker]:
        """The decode workers that may take the pinned KV: paired by revision with its prefill
        worker (and loading the request's adapter on demand, if they do)."""
        return self.o.selector.pool(ROLE_DECODE, call.model, partners=[pin.worker], handoff=True)

    async def _open(self, up: UpstreamCall, call: Call, payload: bytes, limits: Limits) -> \
            UpstreamResponse | None:
        """`up.open`, not cut off the moment the client leaves: a connection closed before the
        decode worker has read the request loses it there, and then nobody releases the
        prefill's pin before its TTL. The call goes on for HANDOFF_GRACE_S or until it answers (a
        `Grace` section of the request's own task), so the decode worker has taken the request in
        when it is cut off: it aborts it and releases the pin, as for any client that leaves. (A
        release from here could race that worker's read of the blocks instead.)"""
        grace = Grace(HANDOFF_GRACE_S)
        with grace:
            response = await up.open(PATHS[call.route], payload, call.headers(), limits)
        if grace.gone:
            up.close()  # answered in time: closing the call now, the worker aborts and unpins
            raise asyncio.CancelledError
        return response

    async def _unary(self, call: Call, pool: list[Worker], prefill: Answer, pin: PinnedKV) -> Response:
        o = self.o
        t0 = time.monotonic()
        async with o.upstream_call("decode", ROLE_DECODE, call, pool) as up:
            pin.sent = True
            payload = call.decode_payload(prefill.kv_transfer_params)
            response = await self._open(up, call, payload, o.unary_limits(call))
            if response is None and (elsewhere := o.whole_elsewhere(call, ROLE_DECODE, up)) is not None:
                pin.sent = False  # no decode worker took the params: the pin is ours to release
                up.close()
                call.disaggregated = False
                return await o.direct(call, elsewhere[1], elsewhere[0])
            try:
                content = await o.read_answer(up, response)
            except APIError:
                # No decode worker tried, or each refused it busy (429, before touching the KV):
                # nobody has the params.
                pin.sent = up.attempts > 0 and not up.all_busy
                raise
        o.metrics.handoff.observe(time.monotonic() - t0)
        return o.merged(call, prefill, content)

    async def stream(self, call: Call, prefill: Answer, pin: PinnedKV, first_sent: bool = False) -> \
            Events:
        """The streamed answer: the first token's events (unless `first_sent`), then the decode's.
        The decode pool is chosen once the first token is out: nothing before it waits for that."""
        o = self.o
        # A client that hangs up from here until the decode call is opened leaves the pin to
        # the router (`pin`; stream_response releases it), and after that to the decode worker.
        if not first_sent:
            if first := first_token_events(prefill):
                yield first
            o.observe_ttft(call)
        t0 = time.monotonic()
        # Held from here: a client that hangs up while the decode worker pulls the KV closes
        # this iterator (SSEResponse), which closes the call and releases the worker.
        up = o.upstream_call("decode", ROLE_DECODE, call, self.decode_pool(call, pin))
        try:
            pin.sent = True
            payload = call.decode_payload(prefill.kv_transfer_params)
            response = await self._open(up, call, payload, o.stream_limits)
            if response is None:  # the stream moves (decode_events): a pin nobody has is released now
                pin.sent = up.attempts > 0 and not up.all_busy
                pin.abandon(o.up)
            # Handed to the response, which iterates it directly (protocol/yield_from.py).
            yield o.decode_events(call, up, response, t0, first_token_id(prefill.kv_transfer_params))
        finally:
            up.close()
