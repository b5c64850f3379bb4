"""The streamed hand-off (`--pd-handoff streamed`, the default): the decode call opens while the
prefill still runs, so the KV moves chunk by chunk as the prefill computes it and the second
token does not wait for a whole transfer after the first (issue 24; the wire:
protocol/kv_transfer.py, docs/router.md).

    router ──prefill request, kv_transfer_params.stream_kv──▶ P
    router ◀── 200 application/x-ndjson, line 1: params (P admitted it; blocks pinned, not computed)
      │ ──client body + line 1's params──▶ D    at once; D pulls each chunk as P finishes it
      │                                          and learns the first token from P's side channel
      ▼ ◀── line 2, read while D's status is awaited: P's ordinary answer, or {"error"}
    first token ended the request  ──▶ close D's call; P's answer is the whole answer
    error, or P's connection broke ──▶ close D's call; a decode worker prefills locally
    D refused (before line 2)      ──▶ close P's call, release the pin; the decode error
    otherwise ──▶ as after-prefill: the first token from line 2, then D's events / merged answer

A prefill worker that answers plain application/json did not stream the hand-off: the
after-prefill hand-off (after_prefill.py) takes that answer.

Hang-ups: until line 2, closing P's call makes P abort the prefill and cancel its own pin (D's
pull stops and D ends the request aborted), so P's call is closed at once. D's call, while its
status is awaited, goes on for the grace period first, as after-prefill: after line 2 the pin is
final and only D, once it has read the request, releases it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from pydantic import ValidationError
from starlette.responses import Response

from pdserve.protocol.contract import CODE_REQUEST_FAILED, PATHS, ROLE_DECODE
from pdserve.protocol.errors import TYPES, APIError, UpstreamError
from pdserve.protocol.kv_transfer import PARAM as KV_TRANSFER_PARAMS
from pdserve.protocol.kv_transfer import STREAM_UNSUPPORTED
from pdserve.protocol.responses import RESPONSES
from pdserve.protocol.yield_from import Events
from pdserve.router.http1 import UpstreamResponse
from pdserve.router.call import Call, PinnedKV
from pdserve.router.handoff import Handoff, Orchestration
from pdserve.router.handoff.after_prefill import AfterPrefill, Prefilled
from pdserve.router.metrics import RouterMetrics
from pdserve.router.migration import first_token_id
from pdserve.router.splice import Answer, first_token_ended, first_token_events
from pdserve.router.upstream import UPSTREAM_ERRORS, Limits, StreamBroken, read_and_close
from pdserve.router.upstream_call import UpstreamCall
from pdserve.router.workers import Worker

log = logging.getLogger("pdserve.router")

# Line 1 is a KVTransferParams (a block id per prompt block): far below this.
_MAX_FIRST_LINE = 4 * 1024 * 1024


class PrefillFailed(Exception):
    """The prefill failed after its first line: an error line, a malformed answer, a broken
    connection. `clients_fault`: the error line is one of a client error's types (the worker
    refused what the request carries), which is never counted against the worker."""

    def __init__(self, reason: str, clients_fault: bool = False):
        super().__init__(reason)
        self.clients_fault = clients_fault


# The OpenAI error types of 4xx answers (protocol/errors.py): what an error line names when the
# request, not the worker, is at fault (it has no status of its own).
_CLIENT_ERROR_TYPES = frozenset(t for status, t in TYPES.items() if status < 500)


def _clients_fault(content: bytes) -> bool:
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return False
    # A request the prefill's engine failed alone is no fault of the worker's either.
    return isinstance(error, dict) and (error.get("type") in _CLIENT_ERROR_TYPES
                                        or error.get("code") == CODE_REQUEST_FAILED)


class StreamedPrefill:
    """A prefill worker's streamed answer between its two lines. It holds the prefill call (the
    worker counted in flight, the response open) until line 2 is read or it is aborted: closing
    the call is what tells the worker to abort the prefill and cancel its pin."""

    def __init__(self, up: UpstreamCall, params: dict, rest: bytes, started: float, metrics: RouterMetrics):
        self.up = up
        self.worker: Worker = up.worker  # kept: the call forgets it when closed
        self.params = params  # line 1's kv_transfer_params: what the decode worker is sent
        self._rest = rest  # bytes of line 2 that came with line 1
        self._started = started
        self._metrics = metrics

    @classmethod
    async def first_line(cls, up: UpstreamCall, response: UpstreamResponse, started: float,
                         metrics: RouterMetrics) -> "StreamedPrefill":
        """Read line 1. Raises an UPSTREAM_ERRORS exception or ValueError (malformed)."""
        buf = b""
        while (cut := buf.find(b"\n")) < 0:
            if len(buf) > _MAX_FIRST_LINE:
                raise ValueError("the prefill's first line is too long")
            data = await response.readany()
            if not data:
                raise StreamBroken("the prefill's answer ended before its first line")
            buf += data
        line = json.loads(buf[:cut])
        params = line.get(KV_TRANSFER_PARAMS) if isinstance(line, dict) else None
        if not isinstance(params, dict):
            raise ValueError(f"the prefill's first line carries no {KV_TRANSFER_PARAMS}")
        return cls(up, params, buf[cut + 1:], started, metrics)

    async def final(self, route: str) -> Answer:
        """Line 2: the prefill's answer, exactly an after-prefill one. Raises PrefillFailed (the
        call is left open: `failed()` or `abort()` closes it)."""
        try:
            content = self._rest + await self.up.response.read()
        except UPSTREAM_ERRORS as e:
            raise PrefillFailed(repr(e)) from None
        try:
            answer = RESPONSES[route].model_validate_json(content)
            answer.choices[0]
        except (ValidationError, IndexError):
            raise PrefillFailed(f"line 2: {content[:300].decode(errors='replace')}", _clients_fault(content)) from None
        self.up.succeeded()
        self.up.close()  # read to its end: the connection goes back to the pool, nothing is aborted
        self._metrics.prefill.observe(time.monotonic() - self._started)
        return answer

    def failed(self, reason: str) -> None:
        self.up.failed(reason)
        self.up.close()

    def abort(self) -> None:
        self.up.close()


class DecodeLeg:
    """The decode call of a streamed hand-off: opened in the background while the prefill runs.
    Its body is not read before the first token is out."""

    def __init__(self, up: UpstreamCall, grace_s: float):
        self.up = up
        self.opening: asyncio.Task | None = None
        self.refusal: APIError | None = None  # why it was refused, once read
        self._grace_s = grace_s
        self._closed = False

    def open(self, path: str, payload: bytes, headers: dict[str, str], limits: Limits) -> None:
        self.opening = asyncio.ensure_future(self.up.open(path, payload, headers, limits))
        self.opening.add_done_callback(_retrieved)

    async def response(self) -> UpstreamResponse | None:
        # Shielded: a client that leaves here must not cut the request off unread (close() decides).
        return await asyncio.shield(self.opening)

    def refused(self) -> bool:
        """Its status is known and no decode worker took the request."""
        if not self.opening.done():
            return False
        if self.opening.exception() is not None:
            return True
        response = self.opening.result()
        return response is None or response.status != 200

    def drop(self) -> None:
        """Nothing is left for the decode worker to do: cut the call off now (it aborts)."""
        if not self._closed:
            self._closed = True
            self.opening.cancel()
            self.up.close()

    def close(self) -> None:
        """The client left, or the call is over. A decode worker that has not answered yet may
        not have read the request: give it the grace period to, then cut it off; it aborts the
        request and releases the pin, as when any client leaves."""
        if self._closed:
            return
        self._closed = True
        if self.opening.done():
            self.up.close()
        else:
            self.up.close_when_done(self.opening, self._grace_s)


class StreamedHandoff(Handoff[StreamedPrefill]):
    """`after_prefill` takes over where a decode worker cannot take streamed params."""

    def __init__(self, orchestration: Orchestration, after_prefill: AfterPrefill, grace_s: float):
        super().__init__(orchestration)
        self.after_prefill = after_prefill
        self.grace_s = grace_s

    async def run(self, call: Call, prefill: StreamedPrefill) -> Response:
        o = self.o
        model = call.model
        leg = DecodeLeg(o.upstream_call("decode", ROLE_DECODE, call, o.selector.pool(ROLE_DECODE, model,
                                                                                    partners=[prefill.worker],
                                                                                    handoff=True)),
                        self.grace_s)
        limits = o.stream_limits if call.stream else o.unary_limits(call)
        leg.open(PATHS[call.route], call.decode_payload(prefill.params), call.headers(), limits)
        final = asyncio.ensure_future(prefill.final(call.route))
        final.add_done_callback(_retrieved)
        try:
            await asyncio.wait((leg.opening, final), return_when=asyncio.FIRST_COMPLETED)
            if not final.done() and leg.refused():
                refusal = await self._refusal(leg)
                if _stream_unsupported(refusal):
                    # That decode worker pulls from no one: hand over the final params instead.
                    leg.close()
                    return await self.after_prefill.run(call, Prefilled(prefill.worker, await final))
                # No decode worker will read this KV: stop computing it and free the pin.
                final.cancel()
                prefill.abort()
                o.up.release_kv(prefill.worker, prefill.params)
                if (elsewhere := o.whole_elsewhere(call, ROLE_DECODE, leg.up)) is not None:  # fallback.py
                    leg.close()
                    return await o.direct(call, elsewhere[1], elsewhere[0])
                raise refusal
            answer = await final
        except PrefillFailed as e:
            leg.drop()
            if e.clients_fault:  # the decode worker, prefilling itself, gives the request its answer
                prefill.abort()
            else:
                prefill.failed(str(e))
            o.metrics.retries.labels("prefill-local").inc()
            log.warning("the prefill failed after its first line (%s); prefilling on the decode worker", e)
            return await o.direct(call, o.selector.pool(ROLE_DECODE, model))
        except BaseException:  # the client left, or the decode error above
            final.cancel()
            prefill.abort()
            leg.close()
            raise
        if first_token_ended(answer):
            leg.drop()
            return o.finished_by_prefill(call, answer)
        call.disaggregated = True
        since = time.monotonic()
        if call.stream:
            return o.stream_response(call, self._stream(call, prefill, answer, leg, since), held=leg)
        try:
            response = await leg.response()
            if leg.refused():
                refusal = await self._refusal(leg)
                if _stream_unsupported(refusal):
                    leg.close()
                    return await self.after_prefill.run(call, Prefilled(prefill.worker, answer))
                o.up.release_kv(prefill.worker, prefill.params)
                if (elsewhere := o.whole_elsewhere(call, ROLE_DECODE, leg.up)) is not None:  # fallback.py
                    leg.close()
                    call.disaggregated = False
                    return await o.direct(call, elsewhere[1], elsewhere[0])
                raise refusal
            content = await o.read_answer(leg.up, response)
        finally:
            leg.close()
        o.metrics.handoff.observe(time.monotonic() - since)
        return o.merged(call, answer, content)

    async def _refusal(self, leg: DecodeLeg) -> APIError:
        """The error a refused decode call gives the client, as after-prefill (read once)."""
        if leg.refusal is None:
            response = leg.opening.result() if leg.opening.exception() is None else None
            leg.refusal = self.o.no_decode(leg.up) if response is None else \
                UpstreamError(response.status, await read_and_close(response))
        return leg.refusal

    async def _stream(self, call: Call, prefill: StreamedPrefill, answer: Answer, leg: DecodeLeg,
                      since: float) -> Events:
        o = self.o
        try:
            # The first token goes out first, whatever the decode worker has sent meanwhile.
            if first := first_token_events(answer):
                yield first
            o.observe_ttft(call)
            response = await leg.response()
            if leg.refused():
                refusal = await self._refusal(leg)
                if _stream_unsupported(refusal):  # the first token is out: the final params, the rest
                    leg.close()
                    pin = PinnedKV(prefill.worker, answer.kv_transfer_params)
                    try:
                        yield self.after_prefill.stream(call, answer, pin, first_sent=True)  # (yield_from.py)
                    finally:
                        pin.abandon(o.up)
                    return
                o.up.release_kv(prefill.worker, prefill.params)
                if response is None:  # no decode worker took it: decode_events moves the stream
                    yield o.decode_events(call, leg.up, None, since, first_token_id(answer.kv_transfer_params))
                    return
                if isinstance(refusal, UpstreamError):  # as _decode_events words a refusal
                    refusal = APIError(refusal.status, f"decode worker answered {refusal.status}: "
                                                       f"{refusal.content[:300].decode(errors='replace')}")
                yield refusal.sse_event()
                return
            # Handed to the response, which iterates it directly (protocol/yield_from.py).
            yield o.decode_events(call, leg.up, response, since, first_token_id(answer.kv_transfer_params))
        finally:
            leg.close()


def _stream_unsupported(refusal: APIError) -> bool:
    """A decode worker that cannot take streamed params (it pulls from no one) said so."""
    if not isinstance(refusal, UpstreamError) or refusal.status != 400:
        return False
    try:
        error = json.loads(refusal.content).get("error") or {}
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == STREAM_UNSUPPORTED


def _retrieved(task: asyncio.Task) -> None:
    """A task whose failure may be nobody's to report any more (the client left, or the other
    leg decided first): marked retrieved, so asyncio does not log it as lost."""
    if not task.cancelled():
        task.exception()
