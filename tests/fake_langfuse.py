"""A fake Langfuse server for tests: a real HTTP server on 127.0.0.1 taking the SDK's OTLP trace exports.

It speaks the one route the Langfuse SDK sends spans to, `POST /api/public/otel/v1/traces` (OTLP over HTTP,
protobuf, gzip or not), checks the body decodes as an ExportTraceServiceRequest and answers as an OTLP receiver
does. What it received is kept as `Span`s: the Authorization header, trace id, name and attributes.
"""

from __future__ import annotations

import gzip
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

ROUTE = "/api/public/otel/v1/traces"


@dataclass
class Span:
    """One span the server received."""

    auth: str
    trace_id: str
    name: str
    attributes: dict[str, Any]

    def metadata(self) -> dict[str, Any]:
        """The observation's metadata, as the SDK flattens it into `langfuse.observation.metadata.<key>`."""
        prefix = "langfuse.observation.metadata."
        out = {}
        for key, value in self.attributes.items():
            if key.startswith(prefix):
                try:
                    out[key[len(prefix) :]] = json.loads(value)
                except (TypeError, ValueError):
                    out[key[len(prefix) :]] = value
        return out


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


@dataclass
class FakeLangfuse:
    """Start with `with FakeLangfuse() as server:`; `server.url` is the host to give the SDK."""

    status: int = 200
    """What the server answers (a 5xx makes the SDK's exporter retry and give up)."""
    spans: list[Span] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """Requests the server could not take (wrong route, content type or body): a test asserts it stays empty."""

    def __enter__(self) -> FakeLangfuse:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != ROUTE or self.headers.get("Content-Type") != "application/x-protobuf":
                    fake.problems.append(f"{self.path} {self.headers.get('Content-Type')}")
                    self._answer(404, b"")
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    raw = gzip.decompress(raw)
                request = ExportTraceServiceRequest()
                try:
                    request.ParseFromString(raw)
                except Exception as exc:  # a body that is not OTLP
                    fake.problems.append(f"undecodable body: {exc}")
                    self._answer(400, b"")
                    return
                if fake.status == 200:
                    auth = self.headers.get("Authorization", "")
                    for resource in request.resource_spans:
                        for scope in resource.scope_spans:
                            for span in scope.spans:
                                attributes = {a.key: _value(a.value) for a in span.attributes}
                                fake.spans.append(Span(auth, span.trace_id.hex(), span.name, attributes))
                self._answer(fake.status, ExportTraceServiceResponse().SerializeToString())

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def names(self) -> list[str]:
        return [span.name for span in self.spans]
