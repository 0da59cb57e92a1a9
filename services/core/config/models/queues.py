"""The queue sections: gateway senders, async event queues, and a queue's listener.

Each model holds Geode's settings with Geode's defaults; the rules between a
queue's fields (a parallel queue cannot use the THREAD order policy, grouped
transactions need one dispatcher on a serial sender, a listener's class only
with type python) are below the models, as functions of plain data, so they
also run on a raw file that failed elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from ..base import (
    _IMPORT_PATH,
    NAME_PATTERN,
    Problem,
    _as_int,
    _get,
    _invalid,
    _Model,
    _raise_rules,
    _seq,
    check_import_path,
)
from .kafka import RemoteSiteConfig

OrderPolicy = Literal["KEY", "THREAD", "PARTITION"]


def _refuse_persistent(value: Any) -> Any:
    """Geode's queue persistence is not a setting here, in either direction: a queue is a Kafka topic,
    replicated and durable whatever the file says (what Geode's persistent queue gives), and a queue held
    in memory only (Geode's default) cannot be had.  A file that gives it is refused, whatever the value,
    rather than have it accepted and change nothing."""
    raise _invalid(PERSISTENT_REFUSED)


#: The largest batch a queue assembles: a primary holds up to ``max_in_flight`` of them per partition, and
#: its workers' inbox is sized from it (core/queueloop.py).
BATCH_SIZE_MAX = 10_000
#: The longest a batch waits for more events after its first one (ten minutes).
BATCH_TIME_INTERVAL_MS_MAX = 600_000
#: The most memory a queue's primary may hold before it stops reading (64 GiB).
QUEUE_MEMORY_MB_MAX = 65_536

#: Why ``forward_expiration_destroy: true`` of an async event queue is refused.
EXPIRATION_REFUSED = ("not supported, because regions have no entry expiration (no entry-time-to-live or "
                      "entry-idle-time), so no expiration destroy ever happens to forward; leave it false")

#: Why ``persistent`` of a gateway sender or async event queue is refused.
PERSISTENT_REFUSED = ("not supported, because a queue is a Kafka topic and always durable: it outlives every "
                      "restart, as Geode's persistent=true queue does; Geode's default false, a queue in memory "
                      "that a restart of every member loses, has no equivalent. Remove the setting")


def _batch_time_interval_ms(default_ms: Any) -> Any:
    """The ``batch_time_interval_ms`` field, whose Geode default differs: 1000 ms for a gateway sender, 5 ms for
    an async event queue (``...``: required, in the base that leaves it to them)."""
    return Field(
        default_ms, ge=0, le=BATCH_TIME_INTERVAL_MS_MAX,
        description="… or when this long has passed since its first event, whichever comes first",
        json_schema_extra={"geode": "batch-time-interval"})


def _persistent(geode_name: str) -> Any:
    """The refused ``persistent`` field, under Geode's name of it for the kind of queue."""
    return Field(
        None, description="refused, whatever its value: a queue is a Kafka topic and always durable (Geode's "
        f"{geode_name} true); a queue kept in memory only (Geode's default false) cannot be had",
        json_schema_extra={"geode": geode_name})


class _QueueConfig(_Model):
    """What a gateway sender and an async event queue share: their id, how their events are batched and
    spread over the queue's partitions, and how much a primary holds.  Each subclass gives Geode's own
    default of ``batch_time_interval_ms`` and Geode's name of ``persistent``."""

    id: str = Field(pattern=NAME_PATTERN, description="the queue's id, unique among the site's senders and "
                    "async event queues; names its topics", json_schema_extra={"geode": "id"})
    parallel: bool = Field(
        False, description="true: one queue partition per region bucket, every member primary for some; "
        "false (serial): dispatcher_threads partitions", json_schema_extra={"geode": "parallel"})
    batch_size: int = Field(
        100, ge=1, le=BATCH_SIZE_MAX, description="a batch goes out (to the remote site, or to the listener) when "
        "it holds this many events", json_schema_extra={"geode": "batch-size"})
    batch_time_interval_ms: int = _batch_time_interval_ms(...)
    batch_conflation: bool = Field(
        False, description="an update of a key replaces the earlier update of that key still waiting in the batch",
        json_schema_extra={"geode": "enable-batch-conflation"})
    dispatcher_threads: int = Field(
        5, ge=1, le=1024, description="a serial queue's partitions (a parallel one has its region's buckets); "
        "batches going out at once", json_schema_extra={"geode": "dispatcher-threads"})
    order_policy: OrderPolicy = Field(
        "KEY", description="how a serial queue's events are spread over its partitions: by key, by writing "
        "thread, or by the region bucket; a parallel queue cannot use THREAD",
        json_schema_extra={"geode": "order-policy"})
    persistent: bool | None = _persistent("persistent")
    maximum_queue_memory_mb: int = Field(
        100, ge=1, le=QUEUE_MEMORY_MB_MAX,
        description="what a primary holds in memory; beyond it, it stops reading until batches are "
        "removed (the rest waits in Kafka)", json_schema_extra={"geode": "maximum-queue-memory"})

    _check_persistent = field_validator("persistent", mode="before")(_refuse_persistent)


class GatewaySenderConfig(_QueueConfig):
    """A gateway sender (Geode defaults): a queue whose events go to a remote site."""

    batch_time_interval_ms: int = _batch_time_interval_ms(1000)
    persistent: bool | None = _persistent("enable-persistence")
    remote_dsid: int = Field(ge=1, le=255, description="the dsid of the site this sender sends to",
                             json_schema_extra={"geode": "remote-distributed-system-id"})
    alert_threshold_ms: int = Field(
        0, ge=0, description="log an alert while the queue's oldest event is older than this; 0 = no alert",
        json_schema_extra={"geode": "alert-threshold"})
    socket_read_timeout_ms: int = Field(
        0, ge=0, description="a batch not acknowledged within this is sent again; 0 = wait for an ack forever",
        json_schema_extra={"geode": "socket-read-timeout"})
    manual_start: bool = Field(
        False, description="true: the sender starts stopped, until `sluice admin start`",
        json_schema_extra={"geode": "manual-start"})
    group_transaction_events: bool = Field(
        False, description="the events of one put_all / remove_all in a bucket travel in one batch; not with "
        "batch_conflation, and a serial sender needs dispatcher_threads 1",
        json_schema_extra={"geode": "group-transaction-events"})
    retry_interval_ms: int = Field(
        5000, ge=1, description="longest wait between two attempts to send a batch the remote site did not take "
        "(Geode: 5 s)")
    max_batches_in_flight: int = Field(
        4, ge=1, le=64,
        description="batches of a queue partition sent and waiting for their acks at once; removal stays in order")
    event_filters: tuple[str, ...] = _seq(
        description="import paths of classes with before_enqueue, before_transmit and/or after_acknowledgement",
        json_schema_extra={"geode": "gateway-event-filter"})
    event_substitution_filter: str | None = Field(
        None, description="import path of a class whose get_substitute_value(event) replaces the value queued "
        "and sent", json_schema_extra={"geode": "gateway-event-substitution-filter"})
    remote: RemoteSiteConfig | None = Field(
        None, description="the remote site's Kafka cluster and topic prefix, where batches are written and acks "
        "read (Geode finds the remote site through its locators)")

    @field_validator("event_filters")
    @classmethod
    def _check_filters(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        bad = [v for v in value if not _IMPORT_PATH.match(v)]
        if bad:
            raise _invalid(
                f"{bad[0]!r} is not an import path like 'package.module:ClassName' or 'package.module.ClassName'"
            )
        return value

    @field_validator("event_substitution_filter")
    @classmethod
    def _check_substitution(cls, value: str | None) -> str | None:
        return None if value is None else check_import_path(value)

    @model_validator(mode="after")
    def _check_geode_rules(self) -> GatewaySenderConfig:
        _raise_rules(_sender_rules(self.model_dump()))
        return self


class ListenerConfig(_Model):
    """The async event listener an async event queue delivers batches to."""

    type: Literal["sql", "kafka", "python"] = Field(
        description="sql: write-behind to PostgreSQL or SQLite; kafka: forward to a downstream topic; python: "
        "your class")
    class_path: str | None = Field(
        None, description="with type python: import path of the listener class, or an entry point of the group "
        "sluice.listeners", json_schema_extra={"geode": "async-event-listener class-name"})
    settings: dict[str, Any] = Field(
        default_factory=dict, strict=False, description="handed to the listener's init(config) as "
        "config['settings']; the sql and kafka listeners check theirs",
        json_schema_extra={"geode": "async-event-listener parameter"})

    @field_validator("class_path")
    @classmethod
    def _check_class_path(cls, value: str | None) -> str | None:
        return None if value is None else check_import_path(value)

    @model_validator(mode="after")
    def _check_type(self) -> ListenerConfig:
        _raise_rules(_listener_rules(self.model_dump()))
        return self


class AsyncEventQueueConfig(_QueueConfig):
    """An async event queue (Geode defaults): a queue whose events go to a listener."""

    batch_time_interval_ms: int = _batch_time_interval_ms(5)
    pause_event_processing: bool = Field(
        False, description="true: the queue starts paused (events queue up) until `sluice admin resume`",
        json_schema_extra={"geode": "pause-event-processing"})
    forward_expiration_destroy: bool = Field(
        False, description="true is refused: regions have no entry expiration (no entry-time-to-live or "
        "entry-idle-time), so there is no expiration destroy to forward; false, Geode's default, is what happens",
        json_schema_extra={"geode": "forward-expiration-destroy"})
    listener: ListenerConfig | None = Field(
        None, description="where the batches go", json_schema_extra={"geode": "async-event-listener"})

    _check_persistent = field_validator("persistent", mode="before")(_refuse_persistent)

    @field_validator("forward_expiration_destroy")
    @classmethod
    def _refuse_expiration(cls, value: bool) -> bool:
        if value:
            raise _invalid(EXPIRATION_REFUSED)
        return value

    @model_validator(mode="after")
    def _check_geode_rules(self) -> AsyncEventQueueConfig:
        _raise_rules(_queue_rules(self.model_dump()))
        return self


# --- rules within a queue or listener, on plain data ----------------------------


def _order_policy_rules(kind: str, model: type[BaseModel], section: Mapping[str, Any]) -> list[Problem]:
    # Geode: "Parallel Gateway Sender / Async Event Queue can not be created
    # with OrderPolicy THREAD": a parallel queue is ordered per bucket, and a
    # thread's operations span buckets.
    if _get(section, model, "parallel") is True and _get(section, model, "order_policy") == "THREAD":
        return [
            (
                "order_policy",
                "THREAD",
                f"THREAD is not supported by a parallel {kind} (as in Geode): use KEY or PARTITION, or make it serial",
            )
        ]
    return []


def _sender_rules(section: Mapping[str, Any]) -> list[Problem]:
    problems = _order_policy_rules("gateway sender", GatewaySenderConfig, section)
    grouped = _get(section, GatewaySenderConfig, "group_transaction_events") is True
    if grouped and _get(section, GatewaySenderConfig, "batch_conflation") is True:
        problems.append(
            (
                "group_transaction_events",
                True,
                "cannot be combined with batch_conflation (as in Geode): conflation would drop events of a transaction",
            )
        )
    # GEODE-7971: grouping needs one dispatcher on a serial sender, or the
    # events of one transaction could leave through different threads.
    threads = _as_int(_get(section, GatewaySenderConfig, "dispatcher_threads"))
    if grouped and _get(section, GatewaySenderConfig, "parallel") is False and threads is not None and threads > 1:
        problems.append(
            (
                "group_transaction_events",
                True,
                f"needs dispatcher_threads 1 on a serial sender (as in Geode), not {threads}",
            )
        )
    return problems


def _queue_rules(section: Mapping[str, Any]) -> list[Problem]:
    return _order_policy_rules("async event queue", AsyncEventQueueConfig, section)


def _listener_rules(section: Mapping[str, Any]) -> list[Problem]:
    kind = section.get("type")
    class_path = section.get("class_path")
    if kind == "python" and class_path is None:
        return [("class_path", None, "is required when type is python")]
    if kind in ("sql", "kafka") and class_path is not None:
        return [("class_path", class_path, f"is only used when type is python, not {kind}")]
    return []
