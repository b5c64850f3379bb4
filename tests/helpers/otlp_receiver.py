"""A real OTLP trace receiver for tests: OTLP/HTTP (protobuf POSTs to /v1/traces) and, where
grpcio is installed, OTLP/gRPC (TraceService/Export). Both decode ExportTraceServiceRequest into
`ReceivedSpan`s, one list for both, so a test can assert on one trace exported by several
processes over either protocol."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a trace's root
    attributes: dict
    links: tuple[str, ...] = ()  # linked span ids
    error: bool = False
    events: tuple[str, ...] = field(default=())
    start_ns: int = 0  # Unix epoch nanoseconds, as exported
    end_ns: int = 0


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def decode(req: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for rs in req.resource_spans:
        service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(ReceivedSpan(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                        {a.key: _value(a.value) for a in s.attributes},
                                        tuple(link.span_id.hex() for link in s.links), s.status.code == 2,
                                        tuple(e.name for e in s.events), s.start_time_unix_nano,
                                        s.end_time_unix_nano))
    return out


class OTLPReceiver:
    """Started on free ports; `http_url` / `grpc_url` for --otlp-traces-endpoint; `spans` grows."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                ok = self.path == "/v1/traces" and self.headers.get("content-type") == "application/x-protobuf"
                if ok:
                    receiver._add(ExportTraceServiceRequest.FromString(body))
                payload = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        self.http_url = f"http://127.0.0.1:{self._http.server_address[1]}/v1/traces"
        self._grpc = None
        self.grpc_url = None
        try:
            import grpc
            from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
        except ImportError:
            return

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver._add(request)
                return ExportTraceServiceResponse()

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._grpc)
        port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()
        self.grpc_url = f"http://127.0.0.1:{port}"

    def _add(self, req: ExportTraceServiceRequest) -> None:
        with self._lock:
            self.spans.extend(decode(req))

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        if self._grpc is not None:
            self._grpc.stop(None)
