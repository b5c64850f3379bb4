"""The request path: choose workers, prefill, hand off to decode, splice and stream.

    handle() ── P/D? ──▶ prefill (max_tokens=1, kv_transfer_params{do_remote_decode})
                 │          retry other prefill workers; all failed → local prefill on decode
                 ▼
               decode (original request + the prefill's kv_transfer_params)
                 stream: first token sent as soon as prefill answers, then the decode stream
                 non-stream: first token text + decode text, decode's usage (whole request)

Everything before the response status is decided happens here, so bad input and upstream 4xx
reach the client as proper errors; after a stream's 200, failures become one SSE error event.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.responses import Response, StreamingResponse

from pdserve.router.config import RouterConfig
from pdserve.protocol.errors import APIError, UpstreamError
from pdserve.router.policies import Policy, RoutingRequest
from pdserve.router.prompt import estimate_tokens
from pdserve.router.sse import DONE, EventFramer, drop_role_chunk, first_token_events, split_first_event
from pdserve.router.upstream import (UPSTREAM_ERRORS, Attempt, StreamBroken, Upstream, chunks, close, read_and_close,
                                     timeout)
from pdserve.router.workers import Worker

log = logging.getLogger("pdserve.router")

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


@dataclass
class Call:
    """One client request on its way through."""

    route: str  # "chat" or "completions"
    body: dict
    raw: bytes  # the client's bytes, forwarded as-is when nothing was changed
    request_id: str
    routing: RoutingRequest
    started: float
    disaggregated: bool = False

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def headers(self) -> dict[str, str]:
        return {"content-type": "application/json", "x-request-id": self.request_id}


class Orchestrator:
    def __init__(self, config: RouterConfig, upstream: Upstream, prefill_policy: Policy, decode_policy: Policy):
        self.config = config
        self.up = upstream
        self.metrics = upstream.metrics
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        c = config
        self.prefill_timeout = timeout(c.request_timeout_s, c.connect_timeout_s)
        self.stream_timeout = timeout(None, c.connect_timeout_s, c.stream_idle_timeout_s, c.first_byte_timeout_s)

    # ---- worker choice -------------------------------------------------------------------

    def _pool(self, role: str, model: str) -> list[Worker]:
        return [w for w in self.up.workers.pool(role) if not w.models or model in w.models]

    def _pd_wanted(self, body: dict) -> bool:
        if body.get("n", 1) != 1 or body.get("max_tokens") == 1 or body.get("max_completion_tokens") == 1:
            return False  # nothing to hand off after one token; n > 1 is served by one worker
        return estimate_tokens(body) >= self.config.pd_min_prompt_tokens

    @staticmethod
    def _same_revision(a: Worker, b: Worker) -> bool:
        return a.revision is None or b.revision is None or a.revision == b.revision

    # ---- entry ---------------------------------------------------------------------------

    async def handle(self, call: Call) -> Response:
        model = call.body["model"]
        decode_pool = self._pool("decode", model)
        if not decode_pool:
            raise APIError(503, f"no healthy decode worker serves model {model!r}", code="no_workers")
        prefill = None
        if self._pd_wanted(call.body):
            prefill_pool = [p for p in self._pool("prefill", model)
                            if any(self._same_revision(p, d) for d in decode_pool)]
            if prefill_pool:
                prefill = await self._prefill(call, prefill_pool)
        if prefill is not None:
            worker, answer = prefill
            choice = answer["choices"][0]
            if not answer.get("kv_transfer_params") or choice.get("finish_reason") not in (None, "length"):
                # The first token ended the request (EOS or a stop): the prefill answer is the whole answer.
                return self._finished_by_prefill(call, answer)
            call.disaggregated = True
            decode_pool = [d for d in decode_pool if self._same_revision(worker, d)]
            if call.stream:
                return self._stream_response(call, self._pd_stream(call, decode_pool, answer))
            return await self._pd_unary(call, decode_pool, answer)
        return await self._direct(call, decode_pool)

    # ---- prefill -------------------------------------------------------------------------

    def _prefill_body(self, call: Call) -> bytes:
        body = dict(call.body, stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        body.pop("stream_options", None)
        return json.dumps(body).encode()

    async def _prefill(self, call: Call, pool: list[Worker]) -> tuple[Worker, dict] | None:
        """The prefill answer, or None when every prefill worker failed (local prefill follows)."""
        payload = self._prefill_body(call)
        tried: set[int] = set()
        t0 = time.monotonic()
        for attempt in range(1 + self.config.max_retries):
            candidates = [w for w in pool if id(w) not in tried and w.routable()]
            if not candidates:
                break
            worker = self.prefill_policy.choose(candidates, call.routing)
            tried.add(id(worker))
            if attempt:
                self.metrics.retries.labels("prefill").inc()
            with self.up.track(worker):
                result = await self.up.open(worker, PATHS[call.route], payload, call.headers(),
                                            self.prefill_timeout, "prefill")
                if result.retryable:
                    log.info("prefill on %r failed (%s)", worker, result.reason)
                    continue
                try:
                    content = await result.response.read()
                except UPSTREAM_ERRORS as e:
                    self.up.failed(worker, "prefill", repr(e))
                    continue
                finally:
                    close(result.response)
            if result.response.status != 200:
                raise UpstreamError(result.response.status, content)
            try:
                answer = json.loads(content)
                answer["choices"][0]
            except (ValueError, KeyError, IndexError, TypeError):
                self.up.failed(worker, "prefill", "malformed answer")
                continue
            self.up.workers.record_success(worker)
            self.metrics.prefill.observe(time.monotonic() - t0)
            return worker, answer
        self.metrics.retries.labels("prefill-local").inc()
        log.warning("every prefill attempt failed; prefilling on the decode worker")
        return None

    def _finished_by_prefill(self, call: Call, answer: dict) -> Response:
        answer.pop("kv_transfer_params", None)
        self._observe_ttft(call)
        if not call.stream:
            return self._done(call, Response(json.dumps(answer), media_type="application/json"))

        async def events() -> AsyncIterator[bytes]:
            yield first_token_events(call.route, answer)
            choice = answer["choices"][0]
            tail = {k: answer[k] for k in ("id", "created", "model") if k in answer}
            if call.route == "chat":
                tail.update(object="chat.completion.chunk", choices=[{"index": 0, "delta": {}, "logprobs": None,
                                                                       "finish_reason": choice.get("finish_reason")}])
            else:
                tail.update(object="text_completion", choices=[{"index": 0, "text": "", "logprobs": None,
                                                                "finish_reason": choice.get("finish_reason")}])
            yield b"data: " + json.dumps(tail).encode() + b"\n\n"
            if (call.body.get("stream_options") or {}).get("include_usage") and "usage" in answer:
                usage = {k: tail[k] for k in ("id", "created", "model", "object") if k in tail}
                yield b"data: " + json.dumps({**usage, "choices": [], "usage": answer["usage"]}).encode() + b"\n\n"
            yield DONE

        return self._stream_response(call, events())

    # ---- decode --------------------------------------------------------------------------

    async def _open_decode(self, call: Call, pool: list[Worker], payload: bytes,
                           limits) -> Attempt:
        """Open the decode call, moving to another worker on connect errors and 5xx."""
        tried: set[int] = set()
        last: Attempt | None = None
        for attempt in range(1 + self.config.max_retries):
            candidates = [w for w in pool if id(w) not in tried and w.routable()]
            if not candidates:
                break
            worker = self.decode_policy.choose(candidates, call.routing)
            tried.add(id(worker))
            if attempt:
                self.metrics.retries.labels("decode").inc()
            self.up.acquire(worker)  # released by the caller via _release once the body is consumed
            last = await self.up.open(worker, PATHS[call.route], payload, call.headers(), limits, "decode")
            if not last.retryable:
                return last
            self.up.release(worker)
            log.info("decode on %r failed (%s)", worker, last.reason)
        if last is None:
            raise APIError(503, "no healthy decode worker", code="no_workers")
        if last.response is not None and last.response.status == 429:
            raise APIError(429, "every decode worker is overloaded", code="overloaded")
        raise APIError(502, f"decode failed on every worker tried (last: {last.reason})", code="upstream_failed")

    def _decode_payload(self, call: Call, kv_transfer_params: dict | None) -> bytes:
        if kv_transfer_params is None:
            return call.raw
        return json.dumps(dict(call.body, kv_transfer_params=kv_transfer_params)).encode()

    async def _direct(self, call: Call, pool: list[Worker]) -> Response:
        limits = self.stream_timeout if call.stream else self.prefill_timeout
        attempt = await self._open_decode(call, pool, self._decode_payload(call, None), limits)
        response = attempt.response
        if response.status != 200:
            self.up.release(attempt.worker)
            raise UpstreamError(response.status, await read_and_close(response))
        if call.stream:
            return self._stream_response(call, self._relay(call, attempt, first_event_is_role=False, ttft=True))
        try:
            content = await response.read()
        except UPSTREAM_ERRORS as e:
            self.up.failed(attempt.worker, "decode", repr(e))
            raise APIError(502, f"decode worker failed mid-response: {e!r}", code="upstream_failed")
        finally:
            close(response)
            self.up.release(attempt.worker)
        self.up.workers.record_success(attempt.worker)
        self._observe_ttft(call)
        return self._done(call, Response(content, media_type="application/json"))

    async def _pd_unary(self, call: Call, pool: list[Worker], prefill: dict) -> Response:
        t0 = time.monotonic()
        attempt = await self._open_decode(call, pool, self._decode_payload(call, prefill["kv_transfer_params"]),
                                          self.prefill_timeout)
        try:
            content = await attempt.response.read()
        except UPSTREAM_ERRORS as e:
            self.up.failed(attempt.worker, "decode", repr(e))
            raise APIError(502, f"decode worker failed mid-response: {e!r}", code="upstream_failed")
        finally:
            close(attempt.response)
            self.up.release(attempt.worker)
        self.metrics.handoff.observe(time.monotonic() - t0)
        if attempt.response.status != 200:
            raise UpstreamError(attempt.response.status, content)
        self.up.workers.record_success(attempt.worker)
        self._observe_ttft(call)
        return self._done(call, Response(json.dumps(merge_unary(call.route, prefill, json.loads(content))),
                                         media_type="application/json"))

    async def _pd_stream(self, call: Call, pool: list[Worker], prefill: dict) -> AsyncIterator[bytes]:
        yield first_token_events(call.route, prefill)
        self._observe_ttft(call)
        t0 = time.monotonic()
        try:
            attempt = await self._open_decode(call, pool, self._decode_payload(call, prefill["kv_transfer_params"]),
                                              self.stream_timeout)
        except APIError as e:
            yield e.sse_event()
            return
        if attempt.response.status != 200:
            content = await read_and_close(attempt.response)
            self.up.release(attempt.worker)
            yield APIError(attempt.response.status,
                              f"decode worker answered {attempt.response.status}: "
                              f"{content[:300].decode(errors='replace')}").sse_event()
            return
        self.metrics.handoff.observe(time.monotonic() - t0)
        async for chunk in self._relay(call, attempt, first_event_is_role=call.route == "chat", ttft=False):
            yield chunk

    async def _relay(self, call: Call, attempt: Attempt, first_event_is_role: bool, ttft: bool) -> AsyncIterator[bytes]:
        """Pass the decode worker's SSE through in whole events; a break becomes one error event."""
        worker, response = attempt.worker, attempt.response
        framer = EventFramer()
        first = True
        try:
            async for data in chunks(response, self.stream_timeout.idle_s):
                out = framer.feed(data)
                if not out:
                    continue
                if first:
                    first = False
                    if first_event_is_role:
                        head, rest = split_first_event(out)
                        out = drop_role_chunk(head) + rest
                    if ttft:
                        self._observe_ttft(call)
                if out:
                    yield out
            if not framer.done:
                raise StreamBroken("stream ended without [DONE]")
            self.up.workers.record_success(worker)
        except UPSTREAM_ERRORS as e:
            self.up.failed(worker, "decode-stream", repr(e))
            yield APIError(502, f"decode worker failed mid-stream: {e!r}", code="upstream_failed").sse_event()
        finally:
            close(response)
            self.up.release(worker)

    # ---- bookkeeping ---------------------------------------------------------------------

    def _observe_ttft(self, call: Call) -> None:
        self.metrics.ttft.observe(time.monotonic() - call.started)

    def _done(self, call: Call, response: Response) -> Response:
        self.metrics.e2e.observe(time.monotonic() - call.started)
        self.metrics.requests.labels(call.route, str(response.status_code), _yes(call.disaggregated)).inc()
        return response

    def _stream_response(self, call: Call, events: AsyncIterator[bytes]) -> StreamingResponse:
        async def timed() -> AsyncIterator[bytes]:
            try:
                async for chunk in events:
                    yield chunk
            finally:
                self.metrics.e2e.observe(time.monotonic() - call.started)
                self.metrics.requests.labels(call.route, "200", _yes(call.disaggregated)).inc()

        return StreamingResponse(timed(), media_type="text/event-stream", headers=SSE_HEADERS)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def merge_unary(route: str, prefill: dict, decode: dict) -> dict:
    """The whole answer of a non-streaming P/D request: first token + decode text; the decode
    worker's usage already counts the whole request once."""
    first, rest = prefill["choices"][0], decode["choices"][0]
    if route == "chat":
        msg = rest.setdefault("message", {"role": "assistant"})
        msg["content"] = ((first.get("message") or {}).get("content") or "") + (msg.get("content") or "")
        lp_first, lp_rest = first.get("logprobs"), rest.get("logprobs")
        if lp_first and lp_rest:
            lp_rest["content"] = (lp_first.get("content") or []) + (lp_rest.get("content") or [])
    else:
        head = first.get("text", "")
        rest["text"] = head + (rest.get("text") or "")
        lp_first, lp_rest = first.get("logprobs"), rest.get("logprobs")
        if lp_first and lp_rest:
            for key in ("tokens", "token_logprobs", "top_logprobs"):
                lp_rest[key] = (lp_first.get(key) or []) + (lp_rest.get(key) or [])
            lp_rest["text_offset"] = (lp_first.get("text_offset") or []) + [
                o + len(head) for o in lp_rest.get("text_offset") or []]
    decode.pop("kv_transfer_params", None)
    return decode
