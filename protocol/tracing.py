"""OpenTelemetry traces of requests (`--otlp-traces-endpoint`, as vLLM's flag), router and worker.

Off (no endpoint), `Tracing.off()` answers every call with nothing and the OpenTelemetry SDK is
never imported: no cost. On, spans go through a BatchSpanProcessor: ending a span appends it to
a bounded in-memory queue and a background thread exports batches over OTLP
(`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`: `grpc`, or `http/protobuf` (the default, as vLLM's)).
The request path never waits on the collector: a slow or unreachable one fills the queue, and
what does not fit, or fails to export, is counted in `pdserve_tracing_dropped_spans_total`.
The SDK's own `OTEL_*` variables apply (OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER[_ARG],
OTEL_EXPORTER_OTLP_TRACES_HEADERS/TIMEOUT, OTEL_BSP_*).

Context travels as W3C `traceparent`/`tracestate`: from the client to the router (a missing or
malformed header starts a new trace), from the router to each worker it calls (headers), and from
the prefill worker to the decode worker inside the hand-off (`KVTransferParams.trace_context`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Mapping
from urllib.parse import urlsplit

from pdserve.protocol.flags import ConfigError

ENV_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
PROTOCOLS = ("http/protobuf", "grpc")
TRACE_HEADERS = ("traceparent", "tracestate")
DROPPED = "pdserve_tracing_dropped_spans"
# One export's deadline unless OTEL_EXPORTER_OTLP_TRACES_TIMEOUT says otherwise: an unreachable
# collector then holds the export thread (never a request) this long per batch.
_EXPORT_TIMEOUT_S = 5.0
# What a shutdown waits for the last batch: a dead collector must not hold a pod's exit.
_FLUSH_AT_EXIT_MS = 2000
_SCOPE = "pdserve"  # the instrumentation scope of every span

log = logging.getLogger("pdserve.tracing")


def check_endpoint(url: str | None, flag: str = "--otlp-traces-endpoint", environ=None) -> None:
    """A config's validation: the endpoint is a URL and the protocol one the exporters speak."""
    if url is None:
        return
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(flag, f"{url!r} is not an http(s)://host:port URL")
    proto = protocol(environ)
    if proto not in PROTOCOLS:
        raise ConfigError(flag, f"${ENV_PROTOCOL} must be one of {', '.join(PROTOCOLS)}, not {proto!r}")


def protocol(environ=None) -> str:
    env = os.environ if environ is None else environ
    return env.get(ENV_PROTOCOL) or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"


def http_traces_url(url: str) -> str:
    """OTLP/HTTP posts to /v1/traces; an endpoint given as a bare host:port (as for gRPC) gets it."""
    return url if urlsplit(url).path.strip("/") else url.rstrip("/") + "/v1/traces"


class Tracing:
    """One process's tracer. `off()`: every method a no-op returning None (spans are None)."""

    enabled = False

    def __init__(self, provider=None, tracer=None, dropped=None, processor=None):
        self._provider = provider
        self._tracer = tracer
        self._processor = processor
        self.dropped = dropped  # the Prometheus counter, on the registry given to setup()

    @classmethod
    def off(cls) -> "Tracing":
        return cls()

    # ---- context ---------------------------------------------------------------------------

    def extract(self, carrier: Mapping[str, str] | None):
        """The remote parent in W3C headers (or a hand-off's carrier); None: none, or malformed,
        so the span started under it roots a new trace."""
        if not self.enabled or not carrier:
            return None
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        ctx = TraceContextTextMapPropagator().extract({k: v for k, v in carrier.items() if k in TRACE_HEADERS})
        return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None

    def carrier(self, span) -> dict[str, str]:
        """`span`'s context as W3C headers: for an upstream call, or inside a hand-off."""
        if span is None:
            return {}
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        out: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(out, trace.set_span_in_context(span))
        return out

    # ---- spans -----------------------------------------------------------------------------

    def start(self, name: str, parent=None, *, kind: str = "internal", attributes: dict | None = None,
              start_ns: int | None = None, links=()):
        """A span under `parent` (a span, or an extract()ed context; None: a new trace)."""
        if not self.enabled:
            return None
        from opentelemetry import trace

        ctx = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
        return self._tracer.start_span(name, context=ctx, kind=getattr(trace.SpanKind, kind.upper()),
                                       attributes=_clean(attributes), start_time=start_ns,
                                       links=[trace.Link(s.get_span_context()) for s in links if s is not None])

    def record(self, name: str, parent, start_ns: int, end_ns: int, attributes: dict | None = None,
               links=()) -> None:
        """A finished span from timestamps the engine already keeps (no SDK call in its loop),
        under `parent`, a live span of this process: see _On.record."""

    def link_context(self, carrier: Mapping[str, str] | None):
        """A span-like handle of a remote context, for `links=`: the prefill's span on the decode side."""
        ctx = self.extract(carrier)
        if ctx is None:
            return None
        from opentelemetry import trace

        return trace.get_current_span(ctx)

    @staticmethod
    def end(span, attributes: dict | None = None, error: str | None = None) -> None:
        if span is None:
            return
        if attributes:
            span.set_attributes(_clean(attributes))
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    @staticmethod
    def event(span, name: str, attributes: dict | None = None) -> None:
        if span is not None:
            span.add_event(name, _clean(attributes))

    @staticmethod
    def trace_id(span) -> str | None:
        return None if span is None else format(span.get_span_context().trace_id, "032x")

    def make_current(self, span) -> None:
        """`span` is the current one for the rest of this task (and the tasks it starts): its
        request's log lines carry its trace id (LogTraceIds)."""
        if span is not None:
            from opentelemetry import context, trace

            context.attach(trace.set_span_in_context(span))

    def shutdown(self) -> None:
        if self._provider is not None:
            self._processor.force_flush(_FLUSH_AT_EXIT_MS)
            self._provider.shutdown()


def _clean(attributes: dict | None) -> dict | None:
    return None if attributes is None else {k: v for k, v in attributes.items() if v is not None}


def now_ns() -> int:
    return time.time_ns()


def monotonic_to_ns(t: float) -> int:
    """A time.monotonic() stamp (what the engine keeps) as wall-clock nanoseconds, for a span."""
    return time.time_ns() - int((time.monotonic() - t) * 1e9)


def setup(endpoint: str | None, service_name: str, registry=None, environ=None) -> Tracing:
    """The process's tracing: off without an endpoint; else the SDK, an OTLP exporter behind a
    bounded BatchSpanProcessor, and the dropped-span counter on `registry`."""
    if endpoint is None:
        return Tracing.off()
    from prometheus_client import Counter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult

    env = os.environ if environ is None else environ
    proto = protocol(env)
    timeout = float(env.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or _EXPORT_TIMEOUT_S)
    if proto == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=urlsplit(endpoint).scheme == "http", timeout=timeout)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=http_traces_url(endpoint), timeout=timeout)
    dropped = Counter(DROPPED, "Spans not exported: the queue was full (collector slow or unreachable), or the "
                               "export failed.", ["reason"], registry=registry)
    processor = _CountingProcessor(BatchSpanProcessor(_CountingExporter(exporter, dropped, SpanExportResult)), dropped)
    attrs = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    # shutdown_on_exit off: its atexit flush would wait out an unreachable collector's retries.
    provider = TracerProvider(resource=Resource.create(attrs), shutdown_on_exit=False)
    provider.add_span_processor(processor)
    log.info("tracing: OTLP %s to %s", proto, endpoint)
    return _On(provider, provider.get_tracer(_SCOPE), dropped, processor)


class _On(Tracing):
    enabled = True

    def __init__(self, provider, tracer, dropped, processor):
        super().__init__(provider, tracer, dropped, processor)
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self._scope = InstrumentationScope(_SCOPE)

    def record(self, name: str, parent, start_ns: int, end_ns: int, attributes: dict | None = None,
               links=()) -> None:
        """Made as the finished span it is and handed to the batch processor, without the SDK's
        start and end of a live span (its sampler, attribute validation and locks: half the cost
        of such a span). It follows its parent's sampling, as every built-in sampler would decide
        for a child; an attribute the exporter cannot encode is skipped there, with a log line."""
        if parent is None or not parent.is_recording():
            return
        # Two monotonic stamps made wall-clock apart can cross by a few hundred ns (an empty
        # queue): a zero-length span, not a lost one.
        end_ns = max(end_ns, start_ns)
        from opentelemetry import trace
        from opentelemetry.sdk.trace import ReadableSpan

        up = parent.get_span_context()
        context = trace.SpanContext(up.trace_id, self._provider.id_generator.generate_span_id(), is_remote=False,
                                    trace_flags=up.trace_flags, trace_state=up.trace_state)
        self._processor.on_end(ReadableSpan(
            name, context, parent=up, resource=self._provider.resource, attributes=_clean(attributes) or {},
            links=tuple(trace.Link(s.get_span_context()) for s in links if s is not None),
            instrumentation_scope=self._scope, start_time=start_ns, end_time=end_ns))


class _CountingExporter:
    """The exporter, with each failed batch's spans counted as dropped."""

    def __init__(self, inner, dropped, results):
        self._inner = inner
        self._dropped = dropped
        self._ok = results.SUCCESS

    def export(self, spans):
        try:
            result = self._inner.export(spans)
        except Exception as e:  # a failure here is the collector's, never a request's
            log.debug("span export failed: %s", e)
            result = None
        if result != self._ok:
            self._dropped.labels("export_failed").inc(len(spans))
        return result

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _CountingProcessor:
    """The BatchSpanProcessor, with spans that find its queue full counted (it drops them
    silently). Its queue is read, not changed: without that attribute nothing is counted here."""

    def __init__(self, inner, dropped):
        self._inner = inner
        self._dropped = dropped
        batch = getattr(inner, "_batch_processor", None)
        self._queue = getattr(batch, "_queue", None)

    def on_start(self, span, parent_context=None):
        self._inner.on_start(span, parent_context=parent_context)

    def on_end(self, span):
        q = self._queue
        if q is not None and q.maxlen is not None and len(q) >= q.maxlen:
            self._dropped.labels("queue_full").inc()
        self._inner.on_end(span)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class LogTraceIds(logging.Filter):
    """Appends `trace_id=<32 hex>` to a record logged while a request's span is current."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "trace_id", None):
            from opentelemetry import trace

            ctx = trace.get_current_span().get_span_context()
            if ctx.is_valid:
                record.trace_id = format(ctx.trace_id, "032x")
                record.msg = f"{record.getMessage()} trace_id={record.trace_id}"
                record.args = ()
        return True


def log_trace_ids(tracing: Tracing) -> None:
    """With tracing on, every handler of the root logger tags request log lines (LogTraceIds)."""
    if tracing.enabled:
        for handler in logging.getLogger().handlers:
            if not any(isinstance(f, LogTraceIds) for f in handler.filters):
                handler.addFilter(LogTraceIds())
