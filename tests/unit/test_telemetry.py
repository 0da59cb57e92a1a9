"""core/telemetry.py and core/health.py without Kafka: options, JSON logs, the span file, the probes' answers."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from sluice.core import telemetry
from sluice.core.health import HealthServer
from sluice.core.lifecycle import ServiceState


@pytest.mark.parametrize("raw, port", [(None, 9464), ("0", 0), ("9100", 9100), ("off", None), ("-1", None),
                                       ("OFF", None)])
def test_metrics_port_from_flag_or_environment(raw: str | None, port: int | None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(telemetry.METRICS_PORT_ENV, raising=False)
    assert telemetry.metrics_port(raw) == port
    if raw is not None:
        monkeypatch.setenv(telemetry.METRICS_PORT_ENV, raw)
        assert telemetry.metrics_port(None) == port


@pytest.mark.parametrize("raw", ["http", "70000"])
def test_a_bad_metrics_port_names_the_variable(raw: str) -> None:
    with pytest.raises(ValueError, match="SLUICE_METRICS_PORT / --metrics-port"):
        telemetry.metrics_port(raw)


def test_log_format(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(telemetry.LOG_FORMAT_ENV, raising=False)
    assert telemetry.log_format(None) == "text"
    monkeypatch.setenv(telemetry.LOG_FORMAT_ENV, "json")
    assert telemetry.log_format(None) == "json"
    assert telemetry.log_format("text") == "text"
    with pytest.raises(ValueError, match="text or json"):
        telemetry.log_format("xml")


def test_otlp_is_chosen_by_the_standard_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    assert not telemetry.otlp_wanted("traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces")
    assert telemetry.otlp_wanted("traces")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not telemetry.otlp_wanted("traces")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console,otlp")
    assert telemetry.otlp_wanted("traces")


def test_json_log_lines_carry_the_trace_and_the_extra_fields() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(telemetry.JsonFormatter())
    logger = logging.getLogger("sluice.test.json")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    tracer = TracerProvider().get_tracer("test")
    try:
        logger.warning("ALERT queue %s is %d ms behind", "q", 1200, extra={"alert": "alert_threshold", "queue_id": "q"})
        with tracer.start_as_current_span("op") as span:
            logger.info("inside")
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    first, inside, failed = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["message"] == "ALERT queue q is 1200 ms behind"
    assert first["level"] == "WARNING" and first["logger"] == "sluice.test.json"
    assert first["alert"] == "alert_threshold" and first["queue_id"] == "q"
    assert first["time"].endswith("Z") and "trace_id" not in first
    context = span.get_span_context()
    assert inside["trace_id"] == f"{context.trace_id:032x}" and inside["span_id"] == f"{context.span_id:016x}"
    assert "ValueError: boom" in failed["exception"]


def test_the_span_file_holds_one_json_span_per_line(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    provider = TracerProvider()
    exporter = telemetry.JsonLinesSpanExporter(str(path))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("parent"):
        with tracer.start_as_current_span("child"):
            pass
    provider.shutdown()
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    assert [s["name"] for s in spans] == ["child", "parent"]
    assert spans[0]["context"]["trace_id"] == spans[1]["context"]["trace_id"]
    assert spans[0]["parent_id"] == spans[1]["context"]["span_id"]


class FakeService:
    """What HealthServer probes: a state, a crash, and readiness() reasons."""

    def __init__(self) -> None:
        self.state = ServiceState.NEW
        self.crash: BaseException | None = None
        self.not_ready: dict[str, str] = {"kafka": "no assignment from consumer group g yet"}

    def readiness(self) -> dict[str, str]:
        return dict(self.not_ready)


def test_health_and_readiness_answers_follow_the_service() -> None:
    service = FakeService()
    with HealthServer(service, 0, "127.0.0.1") as server:
        def get(path: str) -> tuple[int, dict[str, object]]:
            response = httpx.get(server.url + path, timeout=5)
            return response.status_code, response.json()

        assert get("/healthz") == (200, {"state": "new"})
        assert get("/readyz") == (503, {"ready": False, "state": "new",
                                        "not_ready": {"state": "the service is new"}})
        service.state = ServiceState.RUNNING
        assert get("/readyz") == (503, {"ready": False, "state": "running",
                                        "not_ready": {"kafka": "no assignment from consumer group g yet"}})
        service.not_ready = {}
        assert get("/readyz") == (200, {"ready": True, "state": "running"})
        service.state, service.crash = ServiceState.CRASHED, RuntimeError("lane died")
        assert get("/healthz") == (503, {"state": "crashed", "crash": "RuntimeError('lane died')"})
        assert get("/readyz")[0] == 503
        assert httpx.get(server.url + "/metrics", timeout=5).status_code == 200
