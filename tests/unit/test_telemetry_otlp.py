"""OTLP export, chosen by the standard OTEL_* variables: a process's metrics and spans reach
an OTLP/HTTP endpoint (here a local HTTP server that keeps what it is sent)."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

REPO = Path(__file__).resolve().parents[2]

# What a service process does: install telemetry, count, trace, exit (flushing both).
CHILD = """
from sluice.core import telemetry
telemetry.install("receiver", site="b", dsid=2)
assert telemetry.tracing()
class Counts:
    def read(self):
        return [(7, {**telemetry.base_attributes("b"), "sluice.component": "receiver"})]
counts = Counts()
telemetry.observe(telemetry.EVENTS_APPLIED, counts.read)
span = telemetry.start_span("gateway.receive", parent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
span.end()
telemetry.installed().shutdown()
"""


@pytest.fixture
def collector() -> Iterator[tuple[str, dict[str, list[bytes]]]]:
    received: dict[str, list[bytes]] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.setdefault(self.path, []).append(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def test_metrics_and_spans_go_to_the_otlp_endpoint(collector: tuple[str, dict[str, list[bytes]]]) -> None:
    endpoint, received = collector
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SERVICE_NAME": "sluice-receiver", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr

    metrics = ExportMetricsServiceRequest.FromString(b"".join(received["/v1/metrics"][-1:]))
    found = {m.name: m for rm in metrics.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    applied = found["sluice.events.applied"]
    assert applied.unit == "{event}" and applied.sum.is_monotonic
    point = applied.sum.data_points[0]
    assert point.as_int == 7
    assert {a.key: a.value.string_value for a in point.attributes}["messaging.system"] == "kafka"

    spans = ExportTraceServiceRequest.FromString(received["/v1/traces"][0])
    (span,) = [s for rs in spans.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert span.name == "gateway.receive"
    assert span.trace_id.hex() == "0af7651916cd43dd8448eb211c80319c"
    assert span.parent_span_id.hex() == "b7ad6b7169203331"
    resource = {a.key: a.value for a in spans.resource_spans[0].resource.attributes}
    assert resource["service.name"].string_value == "sluice-receiver"
    assert resource["sluice.site"].string_value == "b"
