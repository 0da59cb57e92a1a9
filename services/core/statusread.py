"""What a site's queue primaries and gateway receivers last reported, read from Kafka.

``sluice admin status`` (and the status page) shows these, and the fault
harness (``sluice.verify``), the demo and the benchmarks wait on them: a
queue is drained when every partition's size is 0 (``queue_status``), and a
receiver's figures say what it discarded as repeats (``receiver_status``).
They are readers of the site's topics, not part of any one service, so they
live in the core:

* a queue partition's head is the later of its low watermark and the offset
  after the last removal the compacted ``.removals`` topic records; its end
  is the high watermark; the events between them are counted one by one up
  to ``SIZE_COUNT_LIMIT`` offsets (the queues are written in transactions,
  whose markers take offsets too), and the first one's ``enqueued_at`` gives
  the age of the oldest event;
* what each partition's primary last published on the compacted status topic
  (key ``<kind>/<queue>/<partition>``) is shown while it is fresh (30 s), and
  its counters whatever its age;
* every gateway receiver's report (key ``receiver/<member>``), with its age.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .codec import get_codec
from .config import SiteConfig
from .errors import CodecError, InvalidRequest, RegistryUnavailable
from .framing import frames_for
from .kafka import TopicPartition, kafka_errors, make_consumer, read_to_end

#: Offsets of a partition's backlog read to count its events exactly; a longer backlog shows as an
#: upper bound (its span in offsets), so a status of a deep queue stays quick.
SIZE_COUNT_LIMIT = 50_000


@dataclass
class PartitionStatus:
    """One partition of a queue: its head and end, its oldest event, and what its primary last reported."""

    queue_id: str
    partition: int
    primary: str
    state: str
    head: int
    end: int
    oldest_age_s: float | None
    batches: int
    events: int
    redeliveries: int
    dead_lettered: int
    updated_age_s: float | None
    in_flight: int = 0
    last_delivered_age_s: float | None = None
    #: The committed events between head and end, counted one by one; None when the span is
    #: longer than SIZE_COUNT_LIMIT offsets (``size`` is then the span, an upper bound).
    counted: int | None = None

    @property
    def size(self) -> int:
        """Events in the queue.  Offsets are not events: the queues are written in Kafka
        transactions, whose markers (and aborted records) occupy offsets too."""
        return self.counted if self.counted is not None else max(0, self.end - self.head)

    @property
    def size_text(self) -> str:
        return str(self.size) if self.counted is not None or self.size == 0 else f"≤{self.size}"


def kind_of(cfg: SiteConfig, queue_id: str) -> str:
    """ "gateway-sender" or "async-event-queue"; InvalidRequest naming an unknown id."""
    if any(s.id == queue_id for s in cfg.gateway_senders):
        return "gateway-sender"
    if any(q.id == queue_id for q in cfg.async_event_queues):
        return "async-event-queue"
    known = [s.id for s in cfg.gateway_senders] + [q.id for q in cfg.async_event_queues]
    raise InvalidRequest("queue", queue_id, f"no gateway sender or async event queue of that id (have: {known})")


def read_compacted(consumer: Any, topic: str) -> dict[bytes, bytes]:
    """Latest value per key of a one-partition topic."""
    return {msg.key(): msg.value() for msg in read_to_end(consumer, topic)
            if msg.key() is not None and msg.value() is not None}


def _first_and_count(consumer: Any, topic: str, partition: int, head: int, end: int) -> tuple[bytes | None, int | None]:
    """The value of the first committed event at or after ``head``, and the number of them up to the
    end (None past SIZE_COUNT_LIMIT offsets, when only the first is read)."""
    if end - head > SIZE_COUNT_LIMIT:
        consumer.assign([TopicPartition(topic, partition, head)])
        try:
            for msg in consumer.consume(1, 2.0):
                if msg.error() is None:
                    return msg.value(), None
            return None, None
        finally:
            consumer.unassign()
    first, count = None, 0
    for msg in read_to_end(consumer, topic, partition, start=head):
        if first is None:
            first = msg.value()
        count += 1
    return first, count


def queue_status(cfg: SiteConfig, queue_id: str) -> list[PartitionStatus]:
    """Per partition of the queue: head, end, size, oldest event age, and the primary's report."""
    codec = get_codec()
    kind = kind_of(cfg, queue_id)
    names = cfg.topics
    topic = names.queue(queue_id)
    partitions = next(q.partitions for q in cfg.all_attached_queues() if q.id == queue_id)
    consumer = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 50})
    now_ms = int(time.time() * 1000)
    try:
        with kafka_errors(f"reading the status of {queue_id}"):
            removals = {}
            for key, value in read_compacted(consumer, names.removals(queue_id)).items():
                try:
                    removals[int(key)] = codec.decode_as("RemovalRecord", value)
                except (CodecError, ValueError):
                    continue
            reports = {}
            for key, value in read_compacted(consumer, names.status()).items():
                if key.startswith(f"{kind}/{queue_id}/".encode()):
                    try:
                        reports[int(key.rsplit(b"/", 1)[1])] = codec.decode_as("QueueStatus", value)
                    except (CodecError, ValueError):
                        continue
            rows = []
            for p in range(partitions):
                low, end = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                removal = removals.get(p)
                head = max(low, removal["last_removed_offset"] + 1 if removal else low)
                oldest, counted = None, 0 if head >= end else None
                if head < end:
                    first, counted = _first_and_count(consumer, topic, p, head, end)
                    if first is not None:
                        try:
                            enqueued_at = frames_for(cfg).decode_as("QueuedEvent", first)["enqueued_at"]
                            oldest = max(0.0, (now_ms - enqueued_at) / 1000)
                        except (CodecError, RegistryUnavailable):
                            oldest = None
                report = reports.get(p)
                fresh = report is not None and now_ms - report["updated_at"] < 30_000
                rows.append(PartitionStatus(
                    queue_id=queue_id,
                    partition=p,
                    primary=report["primary"] if fresh else "—",
                    state=report["state"] if fresh else ("no primary" if report is None else "stale report"),
                    head=head,
                    end=end,
                    oldest_age_s=oldest,
                    batches=report["batches_dispatched"] if report else 0,
                    events=report["events_dispatched"] if report else 0,
                    redeliveries=report["redeliveries"] if report else 0,
                    dead_lettered=report["dead_lettered"] if report else 0,
                    updated_age_s=(now_ms - report["updated_at"]) / 1000 if report else None,
                    in_flight=report["in_flight"] if fresh else 0,
                    last_delivered_age_s=(now_ms - report["last_accepted_at"]) / 1000
                    if report and report["last_accepted_at"] else None,
                    counted=counted,
                ))
            return rows
    finally:
        consumer.close()


def receiver_status(cfg: SiteConfig) -> list[dict[str, Any]]:
    """What each gateway receiver of the site last reported, with ``age_s``, newest first."""
    codec = get_codec()
    consumer = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 50})
    now_ms = int(time.time() * 1000)
    try:
        with kafka_errors("reading the receivers' status"):
            reports = []
            for key, value in read_compacted(consumer, cfg.topics.status()).items():
                if key.startswith(b"receiver/"):
                    try:
                        report = codec.decode_as("ReceiverStatus", value)
                    except CodecError:
                        continue
                    reports.append({**report, "age_s": (now_ms - report["updated_at"]) / 1000})
            return sorted(reports, key=lambda r: r["age_s"])
    finally:
        consumer.close()


__all__ = ["SIZE_COUNT_LIMIT", "PartitionStatus", "kind_of", "queue_status", "read_compacted", "receiver_status"]
