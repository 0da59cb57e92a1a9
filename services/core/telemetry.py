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
3. gateway sender: a ``send {remote inbound topic}`` span per event; the
   GatewayBatch record carries each event's context in its
   ``sluice-traceparents`` header;
4. receiver (the other site): a ``process {inbound topic}`` span per event,
   passed on in the apply_remote request (``traceparents``);
5. region service there: ``region.apply_remote``, whose context goes on its own
   changelog and queue records (step 1 again);
6. dispatcher: ``process {queue topic}``, one span in each trace of the batch.

The messaging spans (3, 4, 6) are named as OpenTelemetry's messaging
conventions name them, ``{messaging.operation.name} {destination}``, with
``messaging.operation.type`` and ``messaging.destination.name`` set; a send's
destination is the topic it writes to, the remote site's inbound topic.
``span_role`` tells the three apart in a span file (``WAN_TRACE``).

The metric names follow OpenTelemetry's messaging conventions under the
``sluice.`` prefix (below, ``METRICS``); every one carries
``messaging.system=kafka`` and ``sluice.site``, a queue's ones also
``sluice.queue.id``, ``sluice.queue.kind``, ``messaging.destination.name``
and, per partition, ``messaging.destination.partition.id``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import logging
import operator
import os
import sys
import threading
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
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
EVENTS_QUEUED = "sluice.queue.events_queued"
QUEUE_STATE = "sluice.queue.state"
QUEUE_ALERT_THRESHOLD = "sluice.queue.alert_threshold"
PARTITION_PRIMARY = "sluice.queue.partition.primary"
DUPLICATE_BATCHES = "sluice.batches.duplicates_received"

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
    EVENTS_QUEUED: ("{event}", "Events written into a queue (Geode's EventsQueued): counted by the region service "
                               "as each window of writes commits, re-enqueued and wan-copy events included"),
    QUEUE_STATE: ("{state}", "1 for the state a queue is in (sluice.state: running, paused, stopped), 0 for the "
                             "other two, as each member of the queue follows the control topic"),
    QUEUE_ALERT_THRESHOLD: ("s", "The queue's alert-threshold: the age of its oldest event that raises an alert "
                                 "(0: it never does)"),
    PARTITION_PRIMARY: ("{partition}", "1 for each partition of the queue this member is the primary of, 0 for "
                                       "each it is not: a partition whose maximum over the members is 0 has none"),
    DUPLICATE_BATCHES: ("{batch}", "Gateway batches the receiver had applied and acknowledged before "
                                   "(Geode's DuplicateBatchesReceived): acknowledged again, applied not again"),
}

#: The instrument of each metric that is not a counter (counters: the rest of ``METRICS``).
GAUGES = frozenset({QUEUE_SIZE, QUEUE_OLDEST_AGE, SENDER_CONNECTED, CLIENTS, QUEUE_STATE, QUEUE_ALERT_THRESHOLD,
                    PARTITION_PRIMARY})
HISTOGRAMS = frozenset({BATCH_DURATION, LISTENER_DURATION})


def prometheus_names(name: str) -> tuple[str, ...]:
    """The names ``name``'s samples have on /metrics (OpenTelemetry's Prometheus exporter: dots
    become underscores, a unit of seconds adds ``_seconds``, a counter ``_total``, a histogram
    its ``_bucket``, ``_sum`` and ``_count``): what alerts and dashboards select."""
    base = name.replace(".", "_") + ("_seconds" if METRICS[name][0] == "s" else "")
    if name in HISTOGRAMS:
        return (f"{base}_bucket", f"{base}_sum", f"{base}_count")
    return (base,) if name in GAUGES else (f"{base}_total",)


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


# --- queue state, primaries and events queued ---------------------------------------------

#: The states of ``QUEUE_STATE`` (sluice.state), as the control topic names them in upper case.
QUEUE_STATES = ("running", "paused", "stopped")


def observe_queue(primary: Any, owned: Callable[[Any], Iterable[int]]) -> None:
    """Report ``QUEUE_STATE``, ``QUEUE_ALERT_THRESHOLD`` and ``PARTITION_PRIMARY`` for a queue
    primary (core/queueloop.py), read at each collection from what it holds already: its
    ``desired`` state, its ``alert_threshold_ms()``, ``owned(primary)`` (the partitions it is
    the primary of) and ``attributes(partition)``."""
    observe(QUEUE_STATE, queue_state_reader(primary), gauge=True)
    observe(QUEUE_ALERT_THRESHOLD, reader(primary, lambda live: live.alert_threshold_ms() / 1000.0,
                                          lambda live: live.attributes()), gauge=True)
    observe(PARTITION_PRIMARY, partition_primary_reader(primary, owned), gauge=True)


def queue_state_reader(primary: Any) -> Callable[[], Reading]:
    """``QUEUE_STATE`` of ``primary``: 1 for its ``desired`` state, 0 for the other two."""
    def read(live: Any) -> Reading:
        current = str(getattr(live.desired, "value", live.desired)).lower()
        base = live.attributes()
        return [(1 if name == current else 0, {**base, "sluice.state": name}) for name in QUEUE_STATES]
    return _bound(primary, read)


def partition_primary_reader(primary: Any, owned: Callable[[Any], Iterable[int]]) -> Callable[[], Reading]:
    """``PARTITION_PRIMARY`` of ``primary``: every partition of its queue's topic, 1 for those in
    ``owned(primary)``, 0 for the others, so that a partition no member holds is a series whose
    maximum over the members is 0, not a missing one."""
    partitions = next((q.partitions for q in primary.cfg.all_attached_queues()
                       if q.id == primary.queue_id and q.kind == primary.kind), 0)

    def read(live: Any) -> Reading:
        mine = set(owned(live))
        return [(1 if p in mine else 0, live.attributes(p)) for p in range(partitions)]
    return _bound(primary, read)


def _bound(owner: Any, read: Callable[[Any], Reading]) -> Callable[[], Reading]:
    """``read(owner)`` as a reader for :func:`observe`, holding ``owner`` weakly."""
    ref = weakref.ref(owner)

    def bound() -> Reading:
        live = ref()
        return [] if live is None else read(live)
    return bound


_TOPIC = operator.itemgetter(0)


def count_topics(tally: collections.Counter[str], records: Sequence[tuple[Any, Any]],
                 skip: Collection[Any] = ()) -> None:
    """Add the ``(record, tag)`` pairs of one written batch to ``tally``, by each record's topic
    (its first field), leaving out those whose tag is in ``skip``.

    Once per batch, not per record: the pass is ``Counter.update`` over itemgetters, which runs
    in C, so a region service's window of writes costs no Python call per record.  The region
    service reads ``EVENTS_QUEUED`` from it (``events_queued_reader``)."""
    if skip:
        records = [pair for pair in records if pair[1] not in skip]
    tally.update(map(_TOPIC, map(_TOPIC, records)))


def events_queued_reader(owner: Any, tally: Callable[[Any], Mapping[str, int] | None],
                         queues: Mapping[str, Mapping[str, Any]]) -> Callable[[], Reading]:
    """A reader of ``EVENTS_QUEUED``: for each queue topic of ``queues`` (topic → that queue's
    attributes), the count ``tally(owner)`` holds for it, 0 before its first event; the
    tally's other topics (the changelogs) are not queues and are left out."""
    ref = weakref.ref(owner)

    def read() -> Reading:
        live = ref()
        counts = None if live is None else tally(live)
        if counts is None:
            return []
        return [(counts.get(topic, 0), attributes) for topic, attributes in queues.items()]
    return read


def queue_attributes(cfg: Any, **more: Any) -> dict[str, dict[str, Any]]:
    """Queue topic → the attributes its queue's metrics carry (those of core/queueloop.py's
    ``attributes()`` that the site file decides), for every queue of ``cfg`` a region feeds."""
    return {q.topic: {**base_attributes(cfg.site), "sluice.queue.id": q.id, "sluice.queue.kind": q.kind,
                      "messaging.destination.name": q.topic, **more}
            for q in cfg.all_attached_queues()}


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


#: ``messaging.operation.type`` of the messaging spans, by ``messaging.operation.name``.
_OPERATION_TYPES = {"send": "send", "receive": "receive", "process": "process"}


def messaging_span(operation: str, destination: str, *, parent: str | bytes | None = None,
                   kind: trace.SpanKind = trace.SpanKind.INTERNAL,
                   attributes: Mapping[str, Any] | None = None) -> trace.Span:
    """A span named ``{operation} {destination}`` (OpenTelemetry's messaging conventions), with
    ``messaging.operation.name``, ``messaging.operation.type`` and ``messaging.destination.name``
    set over ``attributes``; ``operation`` is send, receive or process."""
    if operation not in _OPERATION_TYPES:
        raise ValueError(f"messaging operation {operation!r}: send, receive or process")
    return start_span(f"{operation} {destination}", parent=parent, kind=kind, attributes={
        **(attributes or {}), "messaging.operation.name": operation,
        "messaging.operation.type": _OPERATION_TYPES[operation], "messaging.destination.name": destination})


def start_span(name: str, *, parent: str | bytes | None = None, kind: trace.SpanKind = trace.SpanKind.INTERNAL,
               attributes: Mapping[str, Any] | None = None) -> trace.Span:
    """A span child of ``parent`` (a traceparent), or a new root; the caller ends it."""
    return tracer().start_span(name, context=context_from(parent), kind=kind, attributes=dict(attributes or {}))


# --- reading a span file (the demo, the tests) -----------------------------------------------------

#: The roles (``span_role``) of the spans of one write on one site, applied on another and handed to a
#: listener, in order.
WAN_TRACE = ("region.put", "gateway.send", "gateway.receive", "region.apply_remote", "listener.process_events")


def span_role(span: Mapping[str, Any]) -> str:
    """What a span of a span file is in a WAN trace: ``gateway.send`` (a gateway sender's send),
    ``gateway.receive`` (the receiver's processing), ``listener.process_events`` (a dispatcher's
    offer to its listener), else its name (``region.put``, ``region.apply_remote`` ...)."""
    attributes = span.get("attributes") or {}
    operation = attributes.get("messaging.operation.name")
    if operation == "send" and attributes.get("sluice.queue.kind") == "gateway-sender":
        return "gateway.send"
    if operation == "process" and attributes.get("sluice.component") == "receiver":
        return "gateway.receive"
    if operation == "process" and attributes.get("sluice.queue.kind") == "async-event-queue":
        return "listener.process_events"
    return str(span["name"])


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
    its send (``gateway.send``) and the receiver's processing (``gateway.receive``), its
    ``region.apply_remote`` at ``target`` and a listener's processing
    (``listener.process_events``), by ``span_role``; oldest first."""
    seen: dict[str, set[tuple[str, str | None]]] = {}
    started: dict[str, str] = {}
    for span in spans:
        trace_id = span["context"]["trace_id"]
        seen.setdefault(trace_id, set()).add((span_role(span), span_site(span)))
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
    "CLIENTS", "CONFLICTS_RESOLVED", "DEAD_LETTERED", "DUPLICATES_DISCARDED", "DUPLICATE_BATCHES", "EVENTS_APPLIED",
    "EVENTS_DELIVERED", "EVENTS_QUEUED", "FAILOVERS", "LISTENER_DURATION", "METRICS", "PARTITION_PRIMARY",
    "QUEUE_ALERT_THRESHOLD", "QUEUE_OLDEST_AGE", "QUEUE_SIZE", "QUEUE_STATE", "QUEUE_STATES",
    "GAUGES", "HISTOGRAMS", "WAN_TRACE", "count_topics", "prometheus_names", "events_queued_reader", "messaging_span", "observe_queue", "partition_primary_reader", "queue_attributes", "queue_state_reader",
    "read_spans", "span_role", "span_site", "wan_traces", "BATCH_TRACEPARENTS", "TRACEPARENT", "JsonFormatter", "JsonLinesSpanExporter", "Telemetry", "add_options",
    "base_attributes", "context_from", "header", "histogram", "install", "installed", "log_format", "meter",
    "metrics_port", "observe", "otlp_wanted", "setup_logging", "start_span", "traceparent_of", "tracer", "tracing",
]
