"""The async-event-queue dispatcher: ``sluice dispatcher -c FILE --queue ID``.

Geode's AsyncEventQueue on Kafka: the queue's primary loop
(``core/queueloop.py``: batching, conflation, identical redelivery, removal
records, failover, pause/resume/stop, status) delivers each batch to the
queue's listener.  ``process_events`` returning ``False`` or raising means
the very same batch is offered again, every event of it flagged
``possible_duplicate`` from then on.  Returning ``Accepted(dead_letters)``
(issue 17) means the batch is taken except those events, which are written
to the queue's dead-letter topic, each acknowledged by the broker, before the
batch counts as delivered; the listener learns it may do so from
``dead_letter_topic`` in its ``init`` config.

Each dispatcher thread has a listener instance of its own (created and
``init``-ed on its first batch, ``close``-d on stop), so a listener never sees
two batches at once; one is built and closed at start so a bad listener
configuration stops the start with its reason.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, Callable

from opentelemetry.trace import SpanKind, StatusCode

from ..core import telemetry
from ..core.asyncevent import Accepted, AsyncEvent, DeadLetter, flag_possible_duplicates, load_listener_class
from ..core.batching import Batch
from ..core.config import SiteConfig
from ..core.errors import InvalidRequest, SluiceError
from ..core.lifecycle import ServiceState
from ..core.queueloop import (
    DesiredState,
    QueuePartition,
    QueuePrimary,
    event_traceparent,
)

log = logging.getLogger("sluice.dispatcher")

__all__ = ["DesiredState", "DispatcherService", "ServiceState"]


class DispatcherService(QueuePrimary):
    """One dispatcher instance of one async event queue."""

    kind = "async-event-queue"

    def __init__(self, cfg: SiteConfig, queue_id: str, *, listener_factory: Callable[[], Any] | None = None,
                 member_id: str | None = None, site_dir: str | None = None) -> None:
        queue = cfg.queue(queue_id)
        super().__init__(cfg, queue_id, queue, member_id=member_id or f"{cfg.site}-dispatcher-{uuid.uuid4().hex[:8]}",
                         start_state=DesiredState.PAUSED if queue.pause_event_processing else DesiredState.RUNNING)
        self._listener_settings = dict(queue.listener.settings) if queue.listener else {}
        #: The site file's folder: where listeners look up relative paths of their settings.
        self._site_dir = site_dir
        if listener_factory is None:
            if queue.listener is None:
                raise SluiceError(f"async event queue {queue_id!r} has no listener in the site file")
            cls = load_listener_class(queue.listener.type, queue.listener.class_path)
            listener_factory = cls
        self._listener_factory = listener_factory
        self._listeners: list[Any] = []
        self._listeners_lock = threading.Lock()
        self._local = threading.local()
        self._listener_duration = telemetry.histogram(telemetry.LISTENER_DURATION)

    def prepare(self) -> None:
        probe = self._listener_factory()
        init = getattr(probe, "init", None)
        if callable(init):
            init(self._listener_config())
        close = getattr(probe, "close", None)
        if callable(close):
            close()

    def deliver(self, part: QueuePartition, batch: Batch[AsyncEvent]) -> bool:
        listener = self._listener()
        spans = self._listener_spans(part, batch) if self._tracing else []
        began = time.monotonic()
        service = f"dispatcher {self.member_id} listener {type(listener).__name__}"
        dead_letters: tuple[DeadLetter, ...] = ()
        try:
            while True:
                if not batch.events:
                    accepted = True  # every event of it was undecodable, and is dead-lettered
                    break
                try:
                    result = listener.process_events(batch.events)
                except Exception:
                    # The listener touched an event whose body does not decode (the first touch
                    # of it): that event is dead-lettered and the rest offered again at once,
                    # possibleDuplicate (it may have applied some of them before it raised).
                    if self.dead_letter_undecodable(batch, service):
                        flag_possible_duplicates(batch)
                        continue
                    raise
                if isinstance(result, Accepted):
                    dead_letters = result.dead_letters
                    self._write_dead_letters(listener, batch, dead_letters)
                    self.dead_letter_undecodable(batch, service, already=[d.event for d in dead_letters])
                    accepted = True
                elif result:
                    # Taken; one it found undecodable and passed over is still not lost unseen.
                    self.dead_letter_undecodable(batch, service)
                    accepted = True
                elif self.dead_letter_undecodable(batch, service):
                    # Refused over an undecodable event: the rest, again, at once, possibleDuplicate.
                    flag_possible_duplicates(batch)
                    continue
                else:
                    accepted = False
                break
        except Exception as exc:
            for span in spans:
                span.record_exception(exc)
                span.set_status(StatusCode.ERROR, str(exc))
            raise
        finally:
            self._listener_duration.record(time.monotonic() - began, self._queue_attributes())
            for span in spans:
                span.end()
        for span in spans:
            span.set_attribute("sluice.batch.accepted", accepted)
            span.set_attribute("sluice.batch.dead_lettered", len(dead_letters))
        return accepted

    def _write_dead_letters(self, listener: Any, batch: Batch[AsyncEvent],
                            dead_letters: tuple[DeadLetter, ...]) -> None:
        """Each event the listener rejected, durably in the dead-letter topic, before the batch is accepted."""
        offered = {(e.partition, e.offset) for e in batch.events}
        for letter in dead_letters:
            if not isinstance(letter, DeadLetter) or (letter.event.partition, letter.event.offset) not in offered:
                # The listener's bug; refusing the batch keeps every event.
                raise InvalidRequest("process_events", letter,
                                     f"Accepted.dead_letters must hold DeadLetter entries of batch {batch.batch_id}'s "
                                     "own events")
        for letter in dead_letters:
            self.dead_letter_event(letter.event, letter.reason, letter.error_class,
                                   f"dispatcher {self.member_id} listener {type(listener).__name__}")

    def _listener_spans(self, part: QueuePartition, batch: Batch[AsyncEvent]) -> list[Any]:
        """A ``process {queue topic}`` span in each trace the batch's events belong to."""
        attributes = {**self.attributes(part.tp.partition), "messaging.operation.name": "process",
                      "messaging.batch.message_count": len(batch.events), "sluice.batch.id": batch.batch_id,
                      "sluice.listener": type(self._listener()).__name__}
        traces = dict.fromkeys(tp for tp in map(event_traceparent, batch.events) if tp is not None)
        return [telemetry.messaging_span("process", self.topic, parent=tp, kind=SpanKind.CONSUMER,
                                         attributes=attributes) for tp in traces]

    def on_stopped(self) -> None:
        self._close_listeners()

    def release(self) -> None:
        self._close_listeners()

    def _listener(self) -> Any:
        listener = getattr(self._local, "listener", None)
        if listener is None:
            listener = self._listener_factory()
            init = getattr(listener, "init", None)
            if callable(init):
                init(self._listener_config())
            self._local.listener = listener
            with self._listeners_lock:
                self._listeners.append(listener)
        return listener

    def _listener_config(self) -> dict[str, Any]:
        return {
            "settings": dict(self._listener_settings),
            "queue_id": self.queue_id,
            "site": self.cfg.site,
            "dsid": self.cfg.dsid,
            "kafka": self.cfg.kafka.client_settings(),
            "topic_prefix": self.cfg.kafka.topic_prefix,
            # This host writes what process_events returns in Accepted.dead_letters here.
            "dead_letter_topic": self.dlq_topic,
            "site_dir": self._site_dir,
            # The regions whose events reach this queue (a listener may prepare per region, e.g. topics).
            "regions": [region.name for region in self.cfg.regions if self.queue_id in region.async_event_queues],
        }

    def _close_listeners(self) -> None:
        with self._listeners_lock:
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            close = getattr(listener, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as exc:  # a listener's close must not stop the shutdown
                    log.warning("closing listener %r: %s", listener, exc)
        # Worker threads create a fresh listener on their next batch.
        self._local = threading.local()
