"""One trace per request across router, prefill and decode (--otlp-traces-endpoint), exported to a
real OTLP receiver: the router over gRPC, the workers over HTTP/protobuf. The client's
traceparent continues (a malformed one starts a new trace), every span's parent is the span that
caused it, the decode side's KV transfer links the prefill's span, and a collector that is not
there fails no request."""

from __future__ import annotations

import logging
import os
import secrets

import httpx
import pytest

from pdserve.protocol.tracing import LogTraceIds, setup
from tests.helpers.otlp_receiver import OTLPReceiver
from tests.net import free_port
from tests.router.test_failures import eventually

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


@pytest.fixture(scope="module")
def receiver():
    r = OTLPReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def stack(module_launch, tiny_checkpoint, receiver):
    assert receiver.grpc_url, "grpcio (the dev extra) is needed for the gRPC receiver"
    env = {**os.environ, **FAST_EXPORT}
    prefill, decode = module_launch.real_pd_workers(tiny_checkpoint("llama"), "--otlp-traces-endpoint",
                                                    receiver.http_url, env=env)
    router = module_launch.router("--prefill", prefill.url, "--decode", decode.url, "--otlp-traces-endpoint",
                                  receiver.grpc_url, env={**env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"})
    return prefill, decode, router


def complete(router, headers: dict, stream: bool = False) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": stream}
    r = httpx.post(router.url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r


def one(spans, **match):
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, [(s.service, s.name) for s in spans])
    return found[0]


def whole_trace(receiver, trace_id: str):
    """The trace, once both workers' request spans and the router's have arrived."""
    def complete_():
        names = {(s.service, s.name) for s in receiver.trace(trace_id)}
        return {("pdserve-router", "router completions"), ("pdserve-worker", "worker prefill"),
                ("pdserve-worker", "worker decode"), ("pdserve-worker", "kv transfer")} <= names
    eventually(complete_)
    return receiver.trace(trace_id)


def test_one_trace_from_the_client_through_prefill_and_decode(stack, receiver):
    _, _, router = stack
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    complete(router, {"traceparent": f"00-{trace_id}-{client_span}-01", "tracestate": "vendor=x"})
    spans = whole_trace(receiver, trace_id)
    root = one(spans, name="router completions")
    assert root.parent_id == client_span and root.attributes["gen_ai.request.model"] == "tiny"
    assert "route" in root.events
    prefill_call = one(spans, name="prefill call")
    decode_call = one(spans, name="decode call")
    assert prefill_call.parent_id == decode_call.parent_id == root.span_id
    worker_prefill = one(spans, name="worker prefill")
    worker_decode = one(spans, name="worker decode")
    assert worker_prefill.parent_id == prefill_call.span_id
    assert worker_decode.parent_id == decode_call.span_id
    assert worker_decode.links == (worker_prefill.span_id,)  # the hand-off carried the prefill's context
    kv = one(spans, name="kv transfer")
    assert kv.parent_id == worker_decode.span_id and kv.links == (worker_prefill.span_id,)
    assert kv.attributes["pdserve.kv.bytes"] > 0 and kv.attributes["pdserve.kv.blocks"] > 0
    for s in spans:
        if s.service == "pdserve-worker" and s.name not in ("worker prefill", "worker decode"):
            assert s.parent_id in (worker_prefill.span_id, worker_decode.span_id), s
    assert one(spans, name="prefill").parent_id == worker_prefill.span_id
    decode = one(spans, name="decode")
    assert decode.parent_id == worker_decode.span_id
    assert worker_decode.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert worker_decode.attributes["gen_ai.usage.completion_tokens"] == 4
    assert worker_prefill.attributes["gen_ai.usage.prompt_tokens"] == worker_decode.attributes[
        "gen_ai.usage.prompt_tokens"] > 0


def test_malformed_traceparent_starts_a_new_trace(stack, receiver):
    _, _, router = stack
    request_id = secrets.token_hex(8)
    complete(router, {"traceparent": "00-nothex-zz-01", "x-request-id": request_id}, stream=True)

    def root():
        return next((s for s in receiver.spans if s.name == "router completions"
                     and s.attributes.get("gen_ai.request.id") == request_id), None)
    eventually(lambda: root() is not None)
    r = root()
    assert r.parent_id == "" and int(r.trace_id, 16) != 0
    spans = whole_trace(receiver, r.trace_id)
    assert one(spans, name="worker decode").parent_id == one(spans, name="decode call").span_id


@pytest.fixture(scope="module")
def failing(module_launch):
    """A prefill worker whose requests fail (500 with /health still 200: the router notices only by
    calling it)."""
    worker = module_launch.fake_worker()
    worker.control(mode="500")
    return worker


def test_a_retry_on_another_prefill_worker_is_in_the_trace(stack, failing, module_launch, receiver):
    """The first prefill worker picked fails: its attempt is an error span, the retry on the pool's
    other worker a sibling, both under the router's request span in the client's trace."""
    prefill, decode, _ = stack
    router = module_launch.router("--prefill", failing.url, "--prefill", prefill.url, "--decode", decode.url,
                                  "--prefill-policy", "round-robin", "--otlp-traces-endpoint", receiver.http_url,
                                  env={**os.environ, **FAST_EXPORT})
    # Round-robin over the pool sorted by URL: the failing worker is the first pick of the first
    # request or of the second, whichever order their ports sort in.
    failed_before = len(failing.requests())
    for _ in range(2):
        trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
        complete(router, {"traceparent": f"00-{trace_id}-{client_span}-01"})
        if len(failing.requests()) > failed_before:
            break
    spans = whole_trace(receiver, trace_id)
    root = one(spans, name="router completions")
    assert root.parent_id == client_span
    calls = sorted((s for s in spans if s.name == "prefill call"), key=lambda s: s.attributes["pdserve.attempt"])
    assert [(c.attributes["pdserve.worker"], c.error, c.attributes["http.response.status_code"]) for c in calls] == [
        (failing.url, True, 500), (prefill.url, False, 200)]
    assert all(c.parent_id == root.span_id for c in calls)
    assert one(spans, name="worker prefill").parent_id == calls[1].span_id
    assert one(spans, name="decode call").parent_id == root.span_id


def test_a_failed_prefill_and_its_fallback_are_in_the_trace(stack, failing, module_launch, receiver):
    """The only prefill worker fails: its attempt is an error span, and the request, prefilled on
    the decode worker instead, is still one trace."""
    _, decode, _ = stack
    router = module_launch.router("--prefill", failing.url, "--decode", decode.url, "--otlp-traces-endpoint",
                                  receiver.http_url, env={**os.environ, **FAST_EXPORT})
    trace_id = secrets.token_hex(16)
    complete(router, {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})

    def arrived():
        names = {s.name for s in receiver.trace(trace_id)}
        return {"router completions", "prefill call", "decode call", "worker whole"} <= names
    eventually(arrived)
    spans = receiver.trace(trace_id)
    root = one(spans, name="router completions")
    failed = one(spans, name="prefill call")
    assert failed.error and failed.parent_id == root.span_id and failed.attributes["pdserve.worker"] == failing.url
    assert not any(s.name == "worker prefill" for s in spans)
    assert one(spans, name="worker whole").parent_id == one(spans, name="decode call").span_id


def test_an_unreachable_collector_fails_no_request(stack, module_launch):
    prefill, decode, _ = stack
    dead = f"http://127.0.0.1:{free_port()}"
    router = module_launch.router("--prefill", prefill.url, "--decode", decode.url, "--otlp-traces-endpoint", dead,
                                  env={**os.environ, **FAST_EXPORT, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "1"})
    for stream in (False, True):
        complete(router, {}, stream=stream)
    # What could not be exported is counted, not lost silently.
    eventually(lambda: 'pdserve_tracing_dropped_spans_total{reason="export_failed"}'
               in httpx.get(router.url + "/metrics").text)


def test_log_lines_carry_the_trace_id(receiver):
    tracing = setup(receiver.http_url, "test", registry=None, environ={})
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(self.format(record))

    handler = Keep()
    handler.addFilter(LogTraceIds())
    log = logging.getLogger("pdserve.test_tracing")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        log.info("outside any request")
        span = tracing.start("request")
        from opentelemetry import context, trace

        token = context.attach(trace.set_span_in_context(span))
        log.info("request %s", "r1")
        context.detach(token)
        tracing.end(span)
    finally:
        log.removeHandler(handler)
        tracing.shutdown()
    assert records == ["outside any request", f"request r1 trace_id={tracing.trace_id(span)}"]
