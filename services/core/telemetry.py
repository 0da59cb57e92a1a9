"""Telemetry of a Sluice service process: metrics, traces and logs.

Configured from the standard ``OTEL_*`` environment, a few ``SLUICE_*``
variables and the service's command line, never from the site file:

==========================================  ===================================================
``SLUICE_METRICS_PORT`` / ``--metrics-port``  /healthz, /readyz and /metrics (core/health.py):
                                              9464 by default, 0 for any free port (logged and
                                              printed), ``off`` or -1 for none
``SLUICE_METRICS_HOST``                       the address it listens on (default 0.0.0.0)
``SLUICE_LOG_FORMAT`` / ``--log-format``      ``text`` (default) or ``json``: one JSON object a
                                              line, with trace_id and span_id when a span is current
``SLUICE_TRACES_FILE``                        every finished span as one JSON line appended to it
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the       OTLP/HTTP export of metrics and traces;
``_METRICS_``/``_TRACES_`` ones),             ``OTEL_METRICS_EXPORTER`` / ``OTEL_TRACES_EXPORTER``
``OTEL_SERVICE_NAME``,                        ``none`` turns one off, ``otlp`` turns it on
``OTEL_RESOURCE_ATTRIBUTES``
==========================================  ===================================================

Metrics are always kept (Prometheus reads them on /metrics); a tracer provider
is installed only when spans go somewhere, so without an exporter every span
is the OpenTelemetry API's no-op and tracing costs nothing on the hot paths.

How one write is traced across sites (W3C trace context, ``traceparent``):

1. region service: the HTTP request (FastAPI's server span) and ``region.put``
   (``region.create`` ...); its traceparent is the ``traceparent`` header of
   the event's changelog record and of its queue records;
2. queue loop: each event read keeps its record's traceparent (``TracedEvent``);
3. gateway sender: a ``gateway.send`` span per event; the GatewayBatch record
   carries each event's context in its ``sluice-traceparents`` header;
4. receiver (the other site): a ``gateway.receive`` span per event, passed on in
   the apply_remote request (``traceparents``);
5. region service there: ``region.apply_remote``, whose context goes on its own
   changelog and queue records (step 1 again);
6. dispatcher: ``listener.process_events``, one span in each trace of the batch.

The metric names follow OpenTelemetry's messaging conventions under the
``sluice.`` prefix (below, ``METRICS``); every one carries
``messaging.system=kafka`` and ``sluice.site``, a queue's ones also
``sluice.queue.id``, ``sluice.queue.kind``, ``messaging.destination.name``
and, per partition, ``messaging.destination.partition.id``.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger("sluice.telemetry")

DEFAULT_METRICS_PORT = 9464
METRICS_PORT_ENV = "SLUICE_METRICS_PORT"
METRICS_HOST_ENV = "SLUICE_METRICS_HOST"
LOG_FORMAT_ENV = "SLUICE_LOG_FORMAT"
TRACES_FILE_ENV = "SLUICE_TRACES_FILE"
#: What turns the health and metrics server off.
DISABLED = ("off", "none", "-1", "")

# --- metric names (OpenTelemetry messaging conventions, `sluice.` prefix) ------------------------

QUEUE_SIZE = "sluice.queue.size"
QUEUE_OLDEST_AGE = "sluice.queue.oldest_event.age"
BATCHES_SENT = "sluice.batches.sent"
BATCHES_ACKNOWLEDGED = "sluice.batches.acknowledged"
BATCHES_RESENT = "sluice.batches.resent"
BATCH_DURATION = "sluice.batch.duration"
EVENTS_DELIVERED = "sluice.events.delivered"
DUPLICATES_DISCARDED = "sluice.events.duplicates_discarded"
CONFLICTS_RESOLVED = "sluice.conflicts.resolved"
DEAD_LETTERED = "sluice.events.dead_lettered"
FAILOVERS = "sluice.failovers"
LISTENER_DURATION = "sluice.listener.duration"
ALERTS = "sluice.alerts"
EVENTS_APPLIED = "sluice.events.applied"
BATCHES_REJECTED = "sluice.batches.rejected"
SENDER_CONNECTED = "sluice.gateway.sender.connected"
CLIENTS = "sluice.subscriptions.clients"
REGISTRATIONS_REFUSED = "sluice.subscriptions.registrations_refused"
EVENTS_NOT_QUEUED = "sluice.subscriptions.events_not_queued"

#: name → (unit, description): the catalogue every service draws from.
METRICS: dict[str, tuple[str, str]] = {
    QUEUE_SIZE: ("{event}", "Events in a queue partition not yet removed (end offset minus head)"),
    QUEUE_OLDEST_AGE: ("s", "Age of the oldest event waiting in a queue partition"),
    BATCHES_SENT: ("{batch}", "Batches sent to the remote site (a sender) or offered to the listener (a dispatcher)"),
    BATCHES_ACKNOWLEDGED: ("{batch}", "Batches acknowledged by the remote site or accepted by the listener"),
    BATCHES_RESENT: ("{batch}", "Batches sent or offered again (no ack, refused, failover)"),
    BATCH_DURATION: ("s", "From a batch's first delivery attempt to its acknowledgement"),
    EVENTS_DELIVERED: ("{event}", "Events delivered and removed from the queue"),
    DUPLICATES_DISCARDED: ("{event}", "Events discarded as repeats, by EventID or batch id"),
    CONFLICTS_RESOLVED: ("{event}", "WAN conflicts resolved against the incoming event"),
    DEAD_LETTERED: ("{event}", "Records written to a dead-letter topic"),
    FAILOVERS: ("{partition}", "Partitions (queue partitions, registry partitions) this member became primary "
                               "for that a primary had served before: a failover, a rebalance or a restart"),
    LISTENER_DURATION: ("s", "Duration of one listener call (process_events) of an async event queue"),
    ALERTS: ("{alert}", "Alerts raised: alert-threshold of a queue, durable-client-timeout of a client, "
                        "maximum-message-count of a client's queue"),
    EVENTS_APPLIED: ("{event}", "Events applied to a region"),
    BATCHES_REJECTED: ("{batch}", "Gateway batches refused (unknown site, bad signature)"),
    SENDER_CONNECTED: ("{sender}", "1 while a remote gateway sender's batches reach this receiver within "
                                   "receiver.max_time_between_pings_ms, else 0 (per source dsid and sender id)"),
    CLIENTS: ("{client}", "Subscription clients this member is primary for"),
    REGISTRATIONS_REFUSED: ("{registration}", "Client registrations refused: no token, or the wrong one"),
    EVENTS_NOT_QUEUED: ("{event}", "Events a client's interest called for that its full queue (maximum-message-count) "
                                   "did not take; the client is then unregistered and resynchronises"),
}

#: Histogram buckets in seconds, for batch and listener latencies (1 ms .. 60 s).
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def meter() -> metrics.Meter:
    """The ``sluice`` meter (a proxy until ``Telemetry`` installs the provider)."""
    return metrics.get_meter("sluice")


def tracer() -> trace.Tracer:
    """The ``sluice`` tracer: the API's no-op unless ``Telemetry`` installed a provider."""
    return trace.get_tracer("sluice")


def histogram(name: str) -> metrics.Histogram:
    unit, description = METRICS[name]
    return meter().create_histogram(name, unit=unit, description=description,
                                    explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S)


def base_attributes(site: str) -> dict[str, str]:
    return {"messaging.system": "kafka", "sluice.site": site}


Reading = Iterable[tuple[float, Mapping[str, Any]]]

_observed: dict[str, list[Callable[[], Callable[[], Reading] | None]]] = {}
_observed_lock = threading.Lock()


def reader(owner: Any, value: Callable[[Any], float | None],
           attributes: Callable[[Any], Mapping[str, Any]]) -> Callable[[], Reading]:
    """A reader for :func:`observe` of ``value(owner)`` with ``attributes(owner)``, holding
    ``owner`` weakly: a service gone, or a ``value`` of None, reports nothing."""
    ref = weakref.ref(owner)

    def read() -> Reading:
        live = ref()
        found = None if live is None else value(live)
        return [] if found is None else [(found, attributes(live))]
    return read


def observe(name: str, read: Callable[[], Reading], *, gauge: bool = False) -> None:
    """Report ``name`` (an observable counter, or a gauge) from ``read()``, which
    returns (value, attributes) pairs at each collection: it reads what the
    service already counts, so nothing is added to a hot path.

    One instrument per name serves every reader of the process (the tests run
    several services in one); a bound method is held weakly, so a service
    gone is no longer read."""
    if hasattr(read, "__self__"):
        ref: Callable[[], Callable[[], Reading] | None] = weakref.WeakMethod(read)  # type: ignore[arg-type]
    else:
        ref = lambda: read  # noqa: E731 - a plain function lives as long as the process
    with _observed_lock:
        readers = _observed.get(name)
        if readers is not None:
            readers.append(ref)
            return
        _observed[name] = readers = [ref]
    unit, description = METRICS[name]

    def callback(_options: CallbackOptions) -> Iterable[Observation]:
        found: list[Observation] = []
        with _observed_lock:
            live = [r for r in (ref() for ref in readers) if r is not None]
            readers[:] = [ref for ref in readers if ref() is not None]
        for reader in live:
            try:
                found.extend(Observation(value, dict(attributes)) for value, attributes in reader())
            except Exception as exc:  # one reader must not fail the scrape; the reason is logged
                log.warning("reading metric %s: %s", name, exc)
        return found

    if gauge:
        meter().create_observable_gauge(name, [callback], unit=unit, description=description)
    else:
        meter().create_observable_counter(name, [callback], unit=unit, description=description)


# --- trace context in records (W3C traceparent) ------------------------------------------------

#: The header of a changelog or queue record: its event's W3C trace context.
TRACEPARENT = "traceparent"
#: The header of a GatewayBatch record: each event's trace context, one per line ("" when it has none).
BATCH_TRACEPARENTS = "sluice-traceparents"

_propagator = TraceContextTextMapPropagator()


def tracing() -> bool:
    """Spans of this process go somewhere.  When not, callers skip all trace work: the
    hot paths then pay one attribute read."""
    return _installed is not None and _installed.tracer_provider is not None


def traceparent_of(span: trace.Span) -> str | None:
    """The W3C ``traceparent`` of ``span`` (None for a no-op span)."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT)


def context_from(traceparent: str | bytes | None) -> Context | None:
    """The context whose parent is ``traceparent``; None when there is none (or it is malformed)."""
    if not traceparent:
        return None
    if isinstance(traceparent, bytes):
        traceparent = traceparent.decode("ascii", "replace")
    context = _propagator.extract({TRACEPARENT: traceparent})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def header(headers: list[tuple[str, bytes]] | None, name: str) -> bytes | None:
    """The value of a Kafka record header (the last one of that name), or None."""
    found = None
    for key, value in headers or ():
        if key == name:
            found = value
    return found


def start_span(name: str, *, parent: str | bytes | None = None, kind: trace.SpanKind = trace.SpanKind.INTERNAL,
               attributes: Mapping[str, Any] | None = None) -> trace.Span:
    """A span child of ``parent`` (a traceparent), or a new root; the caller ends it."""
    return tracer().start_span(name, context=context_from(parent), kind=kind, attributes=dict(attributes or {}))


# --- reading a span file (the demo, the tests) -----------------------------------------------------

#: The spans of one write on one site, applied on another and handed to a listener, in order.
WAN_TRACE = ("region.put", "gateway.send", "gateway.receive", "region.apply_remote", "listener.process_events")


def read_spans(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The spans of a ``SLUICE_TRACES_FILE`` (one JSON object a line)."""
    with open(path, "rb") as f:
        return [orjson.loads(line) for line in f if line.strip()]


def span_site(span: Mapping[str, Any]) -> str | None:
    """The site a span was recorded at: its ``sluice.site``, else its resource's."""
    site = (span.get("attributes") or {}).get("sluice.site")
    return site or ((span.get("resource") or {}).get("attributes") or {}).get("sluice.site")


def wan_traces(spans: Iterable[Mapping[str, Any]], origin: str, target: str) -> list[str]:
    """The trace ids holding a region write at ``origin`` (``region.put``, ``region.create`` ...),
    its ``gateway.send`` and ``gateway.receive``, its ``region.apply_remote`` at
    ``target`` and a ``listener.process_events`` call; oldest first."""
    seen: dict[str, set[tuple[str, str | None]]] = {}
    started: dict[str, str] = {}
    for span in spans:
        trace_id = span["context"]["trace_id"]
        seen.setdefault(trace_id, set()).add((span["name"], span_site(span)))
        started[trace_id] = min(started.get(trace_id, span["start_time"]), span["start_time"])

    def complete(names: set[tuple[str, str | None]]) -> bool:
        written = any(n.startswith("region.") and n != "region.apply_remote" and site == origin
                      for n, site in names)
        rest = {"gateway.send", "gateway.receive", "listener.process_events"} <= {n for n, _ in names}
        return written and rest and ("region.apply_remote", target) in names

    return sorted((t for t, names in seen.items() if complete(names)), key=started.__getitem__)


# --- options -------------------------------------------------------------------------------------

def add_options(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port`` and ``--log-format``, defaulting to their environment variables."""
    parser.add_argument("--metrics-port", default=None, metavar="N",
                        help=f"port of /healthz, /readyz and /metrics (default ${METRICS_PORT_ENV} or "
                             f"{DEFAULT_METRICS_PORT}; 0 for any free port; off or -1 for none)")
    parser.add_argument("--log-format", default=None, choices=("text", "json"),
                        help=f"log lines as text (default) or JSON objects (default ${LOG_FORMAT_ENV})")


def metrics_port(value: str | int | None = None) -> int | None:
    """The health and metrics port from ``--metrics-port`` or the environment; None: off."""
    raw = str(value if value is not None else os.environ.get(METRICS_PORT_ENV, DEFAULT_METRICS_PORT)).strip()
    if raw.lower() in DISABLED:
        return None
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"{METRICS_PORT_ENV} / --metrics-port is {raw!r}: a port number, 0 for any, or off") \
            from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{METRICS_PORT_ENV} / --metrics-port is {port}: not a port (0..65535, or off)")
    return port


def log_format(value: str | None = None) -> str:
    fmt = (value or os.environ.get(LOG_FORMAT_ENV) or "text").lower()
    if fmt not in ("text", "json"):
        raise ValueError(f"{LOG_FORMAT_ENV} / --log-format is {fmt!r}: text or json")
    return fmt


# --- logs ----------------------------------------------------------------------------------------

_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, trace_id and span_id
    when a span is current, the ``extra`` fields of the call, and the exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
            .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            entry["trace_id"] = trace.format_trace_id(context.trace_id)
            entry["span_id"] = trace.format_span_id(context.span_id)
        for key, value in record.__dict__.items():
            if key not in _RECORD_FIELDS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def setup_logging(level: str, fmt: str = "text") -> None:
    """The root logger on stderr, as text (the default) or JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # One line per HTTP request between services (receiver → region service) drowns what matters.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))


# --- traces to a file ------------------------------------------------------------------------------

class JsonLinesSpanExporter(SpanExporter):
    """Appends every span as one JSON line (``ReadableSpan.to_json``) to a file.

    Several processes may share the file: each export is a single ``write`` on
    a descriptor opened with O_APPEND, so lines never interleave."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        data = b"".join(orjson.dumps(orjson.loads(span.to_json(indent=None))) + b"\n" for span in spans)
        with self._lock:
            if self._fd < 0:
                return SpanExportResult.FAILURE
            os.write(self._fd, data)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


# --- the process's providers -----------------------------------------------------------------------

def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def otlp_wanted(signal: str) -> bool:
    """OTLP export of ``signal`` (metrics or traces), by the standard variables."""
    chosen = _env(f"OTEL_{signal.upper()}_EXPORTER").lower()
    if chosen:
        return "otlp" in chosen.split(",")
    return bool(_env("OTEL_EXPORTER_OTLP_ENDPOINT") or _env(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"))


@dataclass
class Telemetry:
    """The metric and trace providers of one service process; ``shutdown()`` flushes them."""

    registry: Any  # the prometheus_client CollectorRegistry /metrics serves
    meter_provider: Any
    tracer_provider: Any | None

    @property
    def tracing(self) -> bool:
        return self.tracer_provider is not None

    def shutdown(self) -> None:
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


_installed: Telemetry | None = None


def install(service_name: str, *, site: str = "", dsid: int | None = None) -> Telemetry:
    """Install this process's meter provider (and tracer provider when spans are
    exported).  Once per process; a second call returns the first."""
    global _installed
    if _installed is not None:
        return _installed
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from prometheus_client import CollectorRegistry

    attributes: dict[str, Any] = {}
    if not _env("OTEL_SERVICE_NAME"):
        attributes["service.name"] = f"sluice-{service_name}"
    if site:
        attributes["sluice.site"] = site
    if dsid is not None:
        attributes["sluice.dsid"] = dsid
    resource = Resource.create(attributes)

    registry = CollectorRegistry(auto_describe=True)
    readers: list[Any] = [PrometheusMetricReader(registry=registry)]
    if otlp_wanted("metrics"):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    metrics.set_meter_provider(meter_provider)

    tracer_provider = None
    exporters: list[SpanExporter] = []
    if otlp_wanted("traces"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        exporters.append(OTLPSpanExporter())
    if _env(TRACES_FILE_ENV):
        exporters.append(JsonLinesSpanExporter(_env(TRACES_FILE_ENV)))
    if exporters:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        tracer_provider = TracerProvider(resource=resource)
        for exporter in exporters:
            tracer_provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1000))
        trace.set_tracer_provider(tracer_provider)
    _installed = Telemetry(registry, meter_provider, tracer_provider)
    log.info("telemetry: metrics%s, traces %s", " (+ OTLP)" if len(readers) > 1 else "",
             "to " + ", ".join(type(e).__name__ for e in exporters) if exporters else "off")
    return _installed


def installed() -> Telemetry | None:
    return _installed


__all__ = [
    "ALERTS", "BATCHES_ACKNOWLEDGED", "BATCHES_REJECTED", "BATCHES_RESENT", "BATCHES_SENT", "BATCH_DURATION",
    "CLIENTS", "CONFLICTS_RESOLVED", "DEAD_LETTERED", "DUPLICATES_DISCARDED", "EVENTS_APPLIED",
    "EVENTS_DELIVERED", "FAILOVERS", "LISTENER_DURATION", "METRICS", "QUEUE_OLDEST_AGE", "QUEUE_SIZE",
    "WAN_TRACE", "read_spans", "span_site", "wan_traces", "BATCH_TRACEPARENTS", "TRACEPARENT", "JsonFormatter", "JsonLinesSpanExporter", "Telemetry", "add_options",
    "base_attributes", "context_from", "header", "histogram", "install", "installed", "log_format", "meter",
    "metrics_port", "observe", "otlp_wanted", "setup_logging", "start_span", "traceparent_of", "tracer", "tracing",
]
