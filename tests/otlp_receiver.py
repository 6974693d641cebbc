"""A real OTLP/HTTP trace receiver for tests: `POST /v1/traces` with an ExportTraceServiceRequest (protobuf), decoded
with the `opentelemetry-proto` package, as a collector would. It keeps every span it received, and every raw body
(for scans for secrets and prompts). No collector binary is installable here; this is the part of one Portico talks
to."""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

KINDS = {Span.SPAN_KIND_SERVER: "server", Span.SPAN_KIND_CLIENT: "client", Span.SPAN_KIND_INTERNAL: "internal"}


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root span
    kind: str  # "server", "client", "internal"
    attributes: dict
    error: bool  # status ERROR
    service: str  # the resource's service.name
    start: int  # unix ns
    end: int


class OtlpReceiver:
    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        """`tls`: served over HTTPS with this server context (a collector behind a private CA)."""
        self.refusing: int | None = None  # a status to answer every export with instead of taking it (a fault)
        self.spans: list[ReceivedSpan] = []
        self.bodies: list[bytes] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server hook
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                if receiver.refusing is not None:
                    self.send_response(receiver.refusing)
                    self.send_header("content-length", "0")
                    if 300 <= receiver.refusing < 400:  # as an ingress that moved the collector to https says
                        self.send_header("location", "https://collector.example:4318/v1/traces")
                    self.end_headers()
                    return
                receiver._receive(body)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self._scheme = "https" if tls is not None else "http"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"{self._scheme}://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _receive(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        spans = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(ReceivedSpan(
                        name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(), kind=KINDS.get(span.kind, str(span.kind)),
                        attributes=_attributes(span.attributes), error=span.status.code == Status.STATUS_CODE_ERROR,
                        service=resource.get("service.name", ""), start=span.start_time_unix_nano,
                        end=span.end_time_unix_nano,
                    ))
        with self._lock:
            self.bodies.append(body)
            self.spans.extend(spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [span for span in self.spans if span.trace_id == trace_id]

    def wait_for(self, found: Callable[[OtlpReceiver], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not found(self):
            if time.monotonic() > deadline:
                raise AssertionError(f"spans did not arrive in {timeout} s; received: {self.spans}")
            time.sleep(0.02)

    def wait_for_trace(self, trace_id: str, *, server_spans: int = 1, timeout: float = 10.0) -> list[ReceivedSpan]:
        """The spans of a trace, once its `server_spans` request spans arrived (they end last)."""
        self.wait_for(lambda r: sum(s.kind == "server" for s in r.trace(trace_id)) >= server_spans, timeout)
        return self.trace(trace_id)


def _attributes(pairs) -> dict:
    return {pair.key: _value(pair.value) for pair in pairs}


def _value(value: AnyValue):
    which = value.WhichOneof("value")
    if which == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
    return getattr(value, which) if which else None
