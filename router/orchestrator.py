"""The request path: choose workers, prefill, hand off to decode, splice and stream.

    handle() ── P/D? ──▶ prefill (max_tokens=1, kv_transfer_params{do_remote_decode[, stream_kv]})
                 │          retry other prefill workers; all failed → local prefill on decode
                 │          streamed answer (NDJSON) → handoff/streamed.py: decode opens at its first line
                 ▼
               decode (original request + the prefill's kv_transfer_params)
                 stream: first token sent as soon as prefill answers, then the decode stream
                 non-stream: first token text + decode text, decode's usage (whole request)

Everything before the response status is decided happens here, so bad input and upstream 4xx
reach the client as proper errors; after a stream's 200, failures become one SSE error event.
Which workers are tried is the selector's business (selection.py); holding, releasing, retrying
and accounting for them is the upstream call's (upstream_call.py); what follows a prefill's
answer is a hand-off's (handoff/), which uses this class through its public methods only.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from typing import AsyncGenerator, AsyncIterator, Sequence

from pydantic import ValidationError
from starlette.responses import Response

from pdserve.protocol.continuation import HEADER_TOKEN_IDS
from pdserve.protocol.contract import PATHS, ROLE_DECODE, ROLE_PREFILL
from pdserve.protocol.disconnect import Grace
from pdserve.protocol.errors import APIError, UpstreamError
from pdserve.protocol.json_response import JSONBytes
from pdserve.protocol.kv_transfer import NDJSON, prefill_request
from pdserve.protocol.responses import RESPONSES
from pdserve.protocol.sse import DONE, SSEResponse
from pdserve.protocol.tracing import Tracing
from pdserve.protocol.yield_from import Events
from pdserve.router.http1 import UpstreamResponse
from pdserve.router.call import Call, PinnedKV
from pdserve.router.config import RouterConfig
from pdserve.router.fallback import RoleFallback
from pdserve.router.migration import Migration, StreamProgress, WorkerDrained, lost_cause
from pdserve.router.peer_prefix import PeerPrefix
from pdserve.router.handoff import HANDOFF_GRACE_S, Closable
from pdserve.router.handoff.after_prefill import AfterPrefill, Prefilled
from pdserve.router.handoff.streamed import StreamedHandoff, StreamedPrefill
from pdserve.router.offload import off_loop
from pdserve.router.prompt import decodes_one_token
from pdserve.router.selection import Selector
from pdserve.router.splice import Answer, closing_events, first_token_events, merge_unary
from pdserve.router.sse import EventFramer, drop_role_chunk, split_first_event, token_events
from pdserve.router.upstream import UPSTREAM_ERRORS, Limits, StreamBroken, Upstream, read_and_close, timeout
from pdserve.router.upstream_call import UpstreamCall
from pdserve.router.workers import Worker

log = logging.getLogger("pdserve.router")


class Orchestrator:
    def __init__(self, config: RouterConfig, upstream: Upstream, selector: Selector):
        self.config = config
        self.up = upstream
        self.metrics = upstream.metrics
        self.selector = selector
        c = config
        self.prefill_limits = timeout(c.request_timeout_s, c.connect_timeout_s)
        self.stream_limits = timeout(None, c.connect_timeout_s, c.stream_idle_timeout_s, c.first_byte_timeout_s)
        self.after_prefill = AfterPrefill(self)
        self.streamed = StreamedHandoff(self, self.after_prefill, HANDOFF_GRACE_S)
        self.fallback = RoleFallback(selector, self.metrics)
        self.migration = Migration(self.fallback, self.metrics, config.max_migrations)
        self.tracing = Tracing.off()  # the app's, set by router/app.py
        # The series a request counts itself in, by model and by (route, status, disaggregated).
        self._arrivals: dict[str, tuple] = {}
        self._answers: dict[tuple, object] = {}
        # (getattr: some tests drive the hand-off with no selector, hence no index)
        self.peer_prefix = PeerPrefix(getattr(selector, "kv_index", None), upstream, self.metrics,
                                      config.kv_peer_prefix_min_tokens)

    def unary_limits(self, call: Call) -> Limits:
        """A non-streaming decode gets what is left of the whole request's budget."""
        connect = self.config.connect_timeout_s
        return Limits(max(self.config.request_timeout_s - (time.monotonic() - call.started), connect), connect)

    def upstream_call(self, phase: str, role: str, call: Call, pool: Sequence[Worker]) -> UpstreamCall:
        return UpstreamCall(self.up, phase, pool, functools.partial(self.selector.choose, role, request=call.routing),
                            self.config.max_retries, functools.partial(self._answered, call), self.tracing, call.span)

    def _answered(self, call: Call, status: int) -> None:
        """A worker answered a call of this request. Its first 2xx (prefill or whole request,
        streamed or not) is when the request counts as an arrival, once: demand the planner sizes
        prefill from (operator/planner.py). What the router or a worker refuses (400, 404, 413, a
        worker's 4xx) never counts, so oversized or malformed requests cannot inflate it."""
        if call.accepted or not 200 <= status < 300:
            return
        call.accepted = True
        model = call.model
        series = self._arrivals.get(model)
        if series is None:
            series = self._arrivals[model] = (self.metrics.child(self.metrics.arrived_requests, model),
                                              self.metrics.child(self.metrics.arrived_prompt_tokens, model))
        series[0].inc()
        series[1].inc(call.prompt_tokens)

    # ---- entry ---------------------------------------------------------------------------

    async def handle(self, call: Call) -> Response:
        model = call.model
        call.tracks_tokens = self.migration.allowed(call)
        pools = self.fallback.availability(model)
        decode_pool = pools.decode
        # No decode worker serves this LoRA adapter, but some load it from a hand-off's params
        # (worker/lora/on_demand.py): only a hand-off may go there, never the whole request.
        loading = not decode_pool and bool(pools.prefill) and call.single_sequence
        if loading:
            decode_pool = self.selector.pool(ROLE_DECODE, model, handoff=True)
            loading = bool(decode_pool)
        if not decode_pool:
            if not pools.prefill:
                raise APIError(503, f"no healthy decode worker serves model {model!r}", code="no_workers")
            # No decode worker: the prefill workers serve whole requests (router/fallback.py).
            self.fallback.served_whole(pools.missing)
            self.tracing.event(call.span, "route", {"pdserve.route": "whole on prefill (no decode worker)"})
            return await self.direct(call, pools.prefill, ROLE_PREFILL)
        prefill = None
        # A hand-off carries one sequence: prompt lists and n > 1 are served whole by one decode
        # worker (prefilling locally): one kv_transfer_params names one request's KV, as in vLLM.
        # With no prefill worker the decider's answer changes only what is counted (a decode
        # prefix hit, a fallback) and traced: with none of those either, it is not asked.
        asks = (pools.prefill or pools.missing is not None or call.span is not None
                or self.selector.decode_prefix.min_uncached)
        wanted = loading or (asks and call.single_sequence and self.selector.disaggregate(call.request))
        if wanted:
            if not loading and self.selector.decode_covers(call.routing, decode_pool):
                self.metrics.decode_prefix_hits.inc()
                self.tracing.event(call.span, "route", {"pdserve.route": "whole on decode (prefix cached)"})
                return await self.direct(call, decode_pool)
            # (a part of the prefill pool: with none there, none here)
            prefill_pool = self.selector.pool(ROLE_PREFILL, model, partners=decode_pool) if pools.prefill else []
            if prefill_pool:
                prefill = await self._prefill(call, prefill_pool, self._streams_kv(call))
            else:
                self.fallback.served_whole(pools.missing)
        if prefill is None and loading:  # no decode worker serves it whole: the prefill role does
            self.tracing.event(call.span, "route", {"pdserve.route": "whole on prefill (adapter on no decode worker)"})
            return await self.direct(call, pools.prefill, ROLE_PREFILL)
        if prefill is None:
            if call.span is not None:  # (no attributes made for nothing: the common way, per request)
                route = "local prefill" if wanted else "whole on decode"
                self.tracing.event(call.span, "route", {"pdserve.route": route})
            return await self.direct(call, decode_pool)
        self.tracing.event(call.span, "route", {"pdserve.route": "disaggregated"})
        if isinstance(prefill, StreamedPrefill):
            return await self.streamed.run(call, prefill)
        return await self.after_prefill.run(call, prefill)

    # ---- prefill -------------------------------------------------------------------------

    def _streams_kv(self, call: Call) -> bool:
        """Ask for the streamed hand-off? Not for a request that cannot go past its first token:
        no decode call would follow (the decider disaggregates none, but a plugin might)."""
        return self.config.pd_handoff == "streamed" and not decodes_one_token(call.request)

    async def _prefill(self, call: Call, pool: list[Worker], stream_kv: bool = False) -> \
            Prefilled | StreamedPrefill | None:
        """`_prefill_call`. A client that leaves meanwhile does not cut the call off at once: a
        prefill that finishes just then pins its KV while its answer, the only record of that
        pin, is lost with the connection. The call goes on for up to HANDOFF_GRACE_S (a `Grace`
        section of the request's own task); an answer in that time has its pin released (no
        decode worker has the params); later, the prefill worker sees the hang-up and aborts a
        request it has not finished. (A streamed answer's first line in that time: its call is
        closed, and the prefill worker aborts and unpins.)"""
        grace = Grace(HANDOFF_GRACE_S)
        with grace:
            prefill = await self._prefill_call(call, pool, stream_kv)
        if grace.gone:
            self._release_unused(prefill)
            raise asyncio.CancelledError
        return prefill

    def _release_unused(self, prefill: Prefilled | StreamedPrefill | None) -> None:
        if prefill is None:
            return
        if isinstance(prefill, StreamedPrefill):
            prefill.abort()
            return
        if prefill.answer.kv_transfer_params:
            self.up.release_kv(prefill.worker, prefill.answer.kv_transfer_params)

    async def _prefill_call(self, call: Call, pool: list[Worker], stream_kv: bool) -> \
            Prefilled | StreamedPrefill | None:
        """The prefill answer, or None when every prefill worker failed (local prefill follows).
        With `stream_kv`, a worker that streams the hand-off gives a StreamedPrefill instead: its
        first line read, its call held open (the StreamedPrefill closes it)."""
        # On a thread when large: a prompt of a million token ids takes json.dumps ~0.1 s.
        def build() -> tuple[dict, bytes]:
            body = prefill_request(call.fields(), stream_kv)
            return body, json.dumps(body).encode()

        body, payload = await off_loop(len(call.raw), build)
        # The prefill worker chosen may lack a prefix another prefill worker holds (peer_prefix.py).
        body_for = (lambda w, ws: self.peer_prefix.prefill_payload(call, w, ws, body)) \
            if self.peer_prefix.enabled else None
        t0 = time.monotonic()
        up = self.upstream_call("prefill", ROLE_PREFILL, call, pool)
        streamed = None
        try:
            while (response := await up.open(PATHS[call.route], payload, call.headers(),
                                             self.prefill_limits, body_for)) is not None:
                if response.status == 200 and response.content_type == NDJSON:
                    try:
                        streamed = await StreamedPrefill.first_line(up, response, t0, self.metrics)
                    except (*UPSTREAM_ERRORS, ValueError) as e:  # closing it: the worker aborts and unpins
                        up.retry_elsewhere(repr(e))
                        continue
                    return streamed
                try:
                    content = await response.read()
                except UPSTREAM_ERRORS as e:
                    up.retry_elsewhere(repr(e))
                    continue
                if response.status != 200:
                    raise UpstreamError(response.status, content)
                try:
                    answer = RESPONSES[call.route].model_validate_json(content)
                    answer.choices[0]
                except (ValidationError, IndexError):
                    up.retry_elsewhere("malformed answer")
                    continue
                up.succeeded()
                self.metrics.prefill.observe(time.monotonic() - t0)
                return Prefilled(up.worker, answer)
        finally:
            if streamed is None:
                up.close()
        self.metrics.retries.labels("prefill-local").inc()
        log.warning("every prefill attempt failed; prefilling on the decode worker")
        return None

    def finished_by_prefill(self, call: Call, answer: Answer) -> Response:
        """The first token ended the request (EOS or a stop): the prefill answer is the whole answer."""
        answer.kv_transfer_params = None
        self.observe_ttft(call)
        if not call.stream:
            return self._done(call, JSONBytes(answer.model_dump_json().encode()))

        async def events() -> AsyncIterator[bytes]:
            yield first_token_events(answer, finished=True)
            yield closing_events(answer, call.include_usage)

        return self.stream_response(call, events())

    # ---- decode --------------------------------------------------------------------------

    @staticmethod
    def no_decode(up: UpstreamCall) -> APIError:
        """The error a decode call that no worker took gives the client."""
        if up.attempts == 0:
            return APIError(503, "no healthy decode worker", code="no_workers")
        if up.last_status == 429:
            return APIError(429, "every decode worker is overloaded", code="overloaded")
        return APIError(502, f"decode failed on every worker tried (last: {up.last_reason})", code="upstream_failed")

    async def read_answer(self, up: UpstreamCall, response: UpstreamResponse | None) -> bytes:
        """A non-streaming decode call's whole answer, once its status is known; errors raised."""
        if response is None:
            raise self.no_decode(up)
        try:
            content = await response.read()
        except UPSTREAM_ERRORS as e:
            up.failed(repr(e))
            raise APIError(502, f"decode worker failed mid-response: {e!r}", code="upstream_failed")
        if response.status != 200:
            raise UpstreamError(response.status, content)
        up.succeeded()
        return content

    async def direct(self, call: Call, pool: list[Worker], role: str = ROLE_DECODE) -> Response:
        """The whole request on one worker of `pool` (decode workers; prefill ones in fallback).
        When no worker of the pool takes it, the other role's workers may (`whole_elsewhere`)."""
        # The worker chosen may lack a prefix another worker of the pool holds (peer_prefix.py).
        body_for = (lambda w, ws: self.peer_prefix.payload(call, w, ws)) if self.peer_prefix.enabled else None
        if call.stream:
            up = self.upstream_call("decode", role, call, pool)
            try:
                response = await up.open(PATHS[call.route], call.raw, call.headers(), self.stream_limits, body_for)
                if response is None:
                    if (elsewhere := self.whole_elsewhere(call, role, up)) is not None:
                        up.close()
                        return await self.direct(call, elsewhere[1], elsewhere[0])
                    raise self.no_decode(up)
                if response.status != 200:
                    raise UpstreamError(response.status, await read_and_close(response))
            except BaseException:
                up.close()
                raise
            # The stream owns the call from here: closed however the stream ends.
            return self.stream_response(call, self._relay(call, up, first_event_is_role=False, ttft=True), up)
        up = self.upstream_call("decode", role, call, pool)
        try:  # (`async with up` costs two coroutines a request; its exit is `close()`)
            response = await up.open(PATHS[call.route], call.raw, call.headers(), self.unary_limits(call), body_for)
            if response is None and (elsewhere := self.whole_elsewhere(call, role, up)) is not None:
                up.close()
                return await self.direct(call, elsewhere[1], elsewhere[0])
            content = await self.read_answer(up, response)
        finally:
            up.close()
        self.observe_ttft(call)
        return self._done(call, JSONBytes(content))

    def whole_elsewhere(self, call: Call, role: str, up: UpstreamCall) -> tuple[str, list[Worker]] | None:
        """No worker of `role` took the call (router/fallback.py): the other role's pool, once
        per request (a call already moved there does not move back)."""
        if call.moved or not self.fallback.unreachable(up):
            return None
        call.moved = True
        self.tracing.event(call.span, "fallback", {"pdserve.failed_role": role})
        return self.fallback.whole_elsewhere(call.model, role)

    def merged(self, call: Call, prefill: Answer, content: bytes) -> Response:
        """A non-streaming hand-off's answer: the prefill's first token + the decode's (`content`)."""
        try:
            decode = RESPONSES[call.route].model_validate_json(content)
            decode.choices[0]
        except (ValidationError, IndexError):
            raise APIError(502, "the decode worker's answer is malformed", code="upstream_failed") from None
        self.observe_ttft(call)
        return self._done(call, JSONBytes(merge_unary(prefill, decode).model_dump_json().encode()))

    def decode_events(self, call: Call, up: UpstreamCall, response: UpstreamResponse | None,
                      since: float, first_token_id: int | None = None) -> AsyncGenerator:
        """A hand-off's decode stream after the first token (`first_token_id`, the prefill's), once
        its status is known: its events relayed. When no decode worker took it (each tried one
        failed or died before its first byte, or none is left), the client has the first token
        already: the stream moves as a continuation of it, as a lost stream does (migration.py),
        to a worker not tried, a prefill worker if no decode worker is left; the hand-off's pool,
        fixed when it began, may have held only the worker that died. One error event (and
        [DONE]) when it cannot move. An async generator the hand-off hands over to its response
        (protocol/yield_from.py): when the decode worker took the call, the relay itself, so its
        events pass no generator but the relay's."""
        if response is None:
            return self._moved(call, up, since, first_token_id)
        if response.status != 200:
            return self._refused(response)
        self.metrics.handoff.observe(time.monotonic() - since)
        return self._relay(call, up, first_event_is_role=call.route == "chat", ttft=False,
                           progress=StreamProgress.after(first_token_id, self.migration.counts_text(call)))

    async def _moved(self, call: Call, up: UpstreamCall, since: float, first_token_id: int | None) -> Events:
        progress = StreamProgress.after(first_token_id, self.migration.counts_text(call))
        moved = None
        if call.tracks_tokens and first_token_id is not None and self.migration.max_migrations > 0:
            moved = await self.migration.move(
                call, progress, up.tried, "busy" if up.all_busy else "lost",
                lambda role, pool: self.upstream_call("decode", role, call, pool), self.stream_limits)
        if moved is None:
            yield self.no_decode(up).sse_event()
            return
        # A continuation opens with no role chunk. The gap the client saw runs from about when
        # its first token went out (`since`), the dead worker's wait included.
        yield self._relay(call, moved, first_event_is_role=False, ttft=False, progress=progress,
                          moves=1, moved_at=since)

    @staticmethod
    async def _refused(response: UpstreamResponse) -> AsyncIterator[bytes]:
        content = await read_and_close(response)
        yield APIError(response.status, f"decode worker answered {response.status}: "
                                        f"{content[:300].decode(errors='replace')}").sse_event()

    async def _relay(self, call: Call, up: UpstreamCall, first_event_is_role: bool, ttft: bool,
                     progress: StreamProgress | None = None, moves: int = 0,
                     moved_at: float | None = None) -> AsyncIterator[bytes]:
        """Pass the decode worker's SSE through in whole events. A break (or a stall) moves the
        stream to another worker while migrations are left (migration.py); else it becomes one
        error event. `moves`: those made before this relay (`up` is then the last one's call,
        `moved_at` when the client got its last event before it)."""
        progress = progress or self.migration.progress(call)
        first = True
        try:
            while True:
                framer = EventFramer()
                # Only a worker that says it reports ids closes its output groups (an older one does not).
                tracking = call.tracks_tokens and up.response.headers.get(HEADER_TOKEN_IDS) == "1"
                response = up.response
                # The response's own timer bounds each wait (http1.py): no task or timeout per chunk,
                # and no async generator between it and this loop.
                response.idle_s = self.stream_limits.idle_s
                try:
                    while data := await response.readany():
                        out = framer.feed(data)
                        if tracking and out:
                            out = progress.relay(out)
                        if not out:
                            if progress.drained:
                                raise WorkerDrained()
                            continue
                        if first:
                            first = False
                            if first_event_is_role:
                                head, rest = split_first_event(out)
                                out = drop_role_chunk(head) + rest
                            if ttft:
                                self.observe_ttft(call)
                        if moved_at is not None:
                            self.metrics.migration_gap.observe(time.monotonic() - moved_at)
                            moved_at = None
                        if out:
                            yield out
                        if progress.drained:
                            raise WorkerDrained()
                    if not framer.done:
                        raise StreamBroken("stream ended without [DONE]")
                    if tracking and (rest := progress.flush()):
                        yield rest
                    up.succeeded()
                    return
                except (*UPSTREAM_ERRORS, WorkerDrained) as e:
                    cause = lost_cause(e)
                    if cause != "drained":  # a drained worker is going away, not failing
                        up.failed(repr(e), "decode-stream")
                    if tracking and progress.finished:
                        yield DONE  # its last token and finish are out: only [DONE] was lost
                        return
                    moved = None
                    if tracking and moves < self.migration.max_migrations:
                        lost, failed_at = up.worker, progress.last_sent or time.monotonic()
                        up.close()
                        moved = await self.migration.move(
                            call, progress, [lost] if lost is not None else [], cause,
                            lambda role, pool: self.upstream_call("decode", role, call, pool), self.stream_limits)
                    if moved is None:
                        yield APIError(502, f"decode worker failed mid-stream: {e!r}",
                                       code="upstream_failed").sse_event()
                        return
                    moves, up, moved_at = moves + 1, moved, failed_at
                    progress.moved()
                    # A continuation opens with no role chunk; a whole resend (nothing was out) with one.
                    first_event_is_role = first_event_is_role and first
        finally:
            up.close()

    # ---- bookkeeping ---------------------------------------------------------------------

    def observe_ttft(self, call: Call) -> None:
        self.metrics.ttft.observe(time.monotonic() - call.started)

    def _done(self, call: Call, response: Response) -> Response:
        self.metrics.e2e.observe(time.monotonic() - call.started)
        key = (call.route, response.status_code, call.disaggregated)
        series = self._answers.get(key)
        if series is None:
            series = self._answers[key] = self.metrics.child(self.metrics.requests, call.route,
                                                             str(response.status_code), _yes(call.disaggregated))
        series.inc()
        return response

    def stream_response(self, call: Call, events: Events, held: Closable | None = None,
                        pin: PinnedKV | None = None) -> SSEResponse:
        """A stream is counted once: just before its `[DONE]` goes to the transport, so a scrape
        made by a client that has seen the end always includes it (on_close runs only after the
        last byte is out, by then the client may have scraped already); or, for a stream that
        ends without `[DONE]` (the client left), when it closes, as the 200 it was sent. The gap
        between its first two token events is observed the same way: before the second goes out."""
        counted = False

        def count() -> None:
            nonlocal counted
            if not counted:
                counted = True
                self.metrics.e2e.observe(time.monotonic() - call.started)
                self.metrics.child(self.metrics.requests, call.route, "200", _yes(call.disaggregated)).inc()

        tokens, first_sent = 0, 0.0

        def sending(chunk: bytes) -> None:
            nonlocal tokens, first_sent
            if tokens < 2 and (n := token_events(chunk, 2 - tokens)):
                now = time.monotonic()
                if tokens == 0:
                    first_sent = now
                tokens += n
                if tokens == 2:  # both in one chunk: sent together, a gap of 0
                    self.metrics.child(self.metrics.first_token_gap, _yes(call.disaggregated)).observe(now - first_sent)
            # [DONE] is always the last event of the chunk that carries it (whole events; JSON
            # escapes newlines, so no data can end this way).
            if chunk.endswith(DONE):
                count()

        def closed() -> None:
            if held is not None:
                held.close()
            if pin is not None:
                pin.abandon(self.up)
            count()

        # A relay yields soon and ends right after its [DONE] (the worker's body ends).
        return SSEResponse(events, on_close=closed, coalesce=True, on_chunk=sending)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"
