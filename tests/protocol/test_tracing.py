"""protocol/tracing.py without servers: off costs no import, a full queue is counted, and a
hand-off's trace context is taken leniently (a malformed one is none, never a refused hand-off)."""

from __future__ import annotations

import subprocess
import sys

from prometheus_client import CollectorRegistry

from pdserve.protocol.kv_transfer import KVTransferParams
from pdserve.protocol.tracing import DROPPED, setup
from tests.net import free_port


def test_off_imports_no_sdk():
    code = ("import sys; from pdserve.protocol.tracing import setup; t = setup(None, 'x'); "
            "t.end(t.start('s')); assert not t.extract({'traceparent': '00-' + '1' * 32 + '-' + '2' * 16 + '-01'}); "
            "assert not any(m.startswith('opentelemetry.sdk') for m in sys.modules), 'SDK imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_spans_past_a_full_queue_are_counted(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")  # nothing leaves the queue meanwhile
    registry = CollectorRegistry()
    tracing = setup(f"http://127.0.0.1:{free_port()}", "test", registry, environ={})
    for _ in range(10):
        tracing.end(tracing.start("s"))
    dropped = registry.get_sample_value(DROPPED + "_total", {"reason": "queue_full"})
    assert dropped is not None and dropped >= 1


PARAMS = {"remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "remote_request_id": "r",
          "remote_block_ids": [0], "num_prompt_tokens": 3, "first_token_id": 1, "transfer_token": "t",
          "kv_layout": "2x4x16:float32:4"}
TRACEPARENT = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"


def test_handoff_trace_context_is_lenient():
    assert "trace_context" not in KVTransferParams.from_dict(PARAMS).to_dict()  # the wire as it was
    ctx = {"traceparent": TRACEPARENT, "tracestate": "a=b"}
    parsed = KVTransferParams.from_dict({**PARAMS, "trace_context": {**ctx, "other": "dropped"}})
    assert parsed.trace_context == ctx and parsed.to_dict()["trace_context"] == ctx
    for malformed in ("00-x", {"tracestate": "a=b"}, {"traceparent": 7}, [TRACEPARENT]):
        assert KVTransferParams.from_dict({**PARAMS, "trace_context": malformed}).trace_context is None


def test_a_span_made_from_stamps_joins_its_parent_and_follows_its_sampling():
    from tests.helpers.otlp_receiver import OTLPReceiver

    receiver = OTLPReceiver()
    try:
        tracing = setup(receiver.http_url, "test", CollectorRegistry(), environ={})
        parent = tracing.start("worker decode", tracing.extract({"traceparent": TRACEPARENT}))
        link = tracing.link_context({"traceparent": "00-" + "1" * 32 + "-" + "3" * 16 + "-01"})
        tracing.record("kv transfer", parent, 2_000, 1_000, {"pdserve.kv.bytes": 4096, "none": None}, links=[link])
        unsampled = tracing.start("worker decode", tracing.extract({"traceparent": TRACEPARENT[:-2] + "00"}))
        tracing.record("queue", unsampled, 1_000, 2_000)
        tracing.end(unsampled)
        tracing.end(parent)
        tracing.shutdown()
    finally:
        receiver.close()
    by_name = {s.name: s for s in receiver.spans}
    assert sorted(by_name) == ["kv transfer", "worker decode"]  # nothing of the unsampled request
    kv, worker = by_name["kv transfer"], by_name["worker decode"]
    assert kv.trace_id == "1" * 32 and kv.parent_id == worker.span_id and kv.links == ("3" * 16,)
    assert kv.service == "test" and kv.attributes == {"pdserve.kv.bytes": 4096}
    assert kv.start_ns == kv.end_ns == 2_000  # crossed stamps: a zero-length span, not a lost one
