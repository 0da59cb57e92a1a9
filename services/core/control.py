"""The site's control topic: the desired state of what ``sluice admin`` steers.

One compacted topic of one partition per site (``topics.control()``).  Each
``ControlRecord`` is keyed ``<kind>/<id>`` and the latest record of a key wins:

========================  ==================  ==============================================
kind                      id                  states (who follows them)
========================  ==================  ==============================================
``async-event-queue``     the queue's id      RUNNING, PAUSED, STOPPED (core/queueloop.py)
``gateway-sender``        the sender's id     RUNNING, PAUSED, STOPPED (core/queueloop.py)
``gateway-receiver``      ``receiver``        RUNNING, STOPPED (receiver/service.py)
========================  ==================  ==============================================

A writer (``write_desired_state``) returns once the broker has the record.
A follower (``ControlFollower``) reads the topic to its end when its service
starts, so the service begins in the state last asked for (a queue or a
receiver with ``manual_start`` begins STOPPED only while nobody has asked for
anything else), then polls it without blocking on every turn of its loop.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from .codec import get_codec
from .errors import CodecError, SluiceError
from .kafka import FOLLOW_FETCH_WAIT_MS, OFFSET_BEGINNING, TopicPartition, kafka_errors, make_consumer, make_producer

if TYPE_CHECKING:
    from .config import SiteConfig

log = logging.getLogger("sluice.control")

#: The control key kind and id of a site's gateway receiver (one per site, as in Geode).
RECEIVER_KIND = "gateway-receiver"
RECEIVER_ID = "receiver"


#: How long a control record written by ``sluice admin`` may take to be acknowledged before the
#: command fails (the operator sees it, rather than a state change that may not have happened).
CONTROL_WRITE_DEADLINE_S = 30.0
#: How long asking the broker for the control topic's end offset may take when a follower starts.
CONTROL_END_DEADLINE_S = 10.0
#: How long one read of the control topic waits for records while a follower reads it to its end,
#: and how long that whole read may take.
CONTROL_READ_WAIT_S = 0.05
CONTROL_READ_DEADLINE_S = 15.0


def control_key(kind: str, target_id: str) -> bytes:
    return f"{kind}/{target_id}".encode()


def write_desired_state(cfg: SiteConfig, kind: str, target_id: str, state: str, issued_by: str = "") -> None:
    """Write ``state`` for ``kind/target_id`` to the control topic and wait until it is durable."""
    producer = make_producer(cfg.kafka.client_settings())
    record = {"kind": kind, "target_id": target_id, "state": state, "issued_by": issued_by,
              "issued_at": int(time.time() * 1000)}
    errors: list[Any] = []
    producer.produce(cfg.topics.control(), get_codec().encode("ControlRecord", record), control_key(kind, target_id),
                     on_delivery=lambda err, _m: errors.append(err))
    if producer.flush(CONTROL_WRITE_DEADLINE_S) or errors != [None]:
        raise SluiceError(f"control record for {kind} {target_id} not acknowledged: {errors}")


class ControlFollower:
    """Follows one key of the control topic: ``read_to_end()`` once, then ``poll_nowait()``.

    Each returns the decoded ``ControlRecord``s of the key in the order they
    were written; one that does not decode is logged and passed over."""

    def __init__(self, cfg: SiteConfig, kind: str, target_id: str, *, client_id: str) -> None:
        self.key = control_key(kind, target_id)
        self.topic = cfg.topics.control()
        self._codec = get_codec()
        self._consumer = make_consumer(cfg.kafka.client_settings(), None,
                                       **{"client.id": client_id, "fetch.wait.max.ms": FOLLOW_FETCH_WAIT_MS})

    def read_to_end(self, deadline_s: float = CONTROL_READ_DEADLINE_S) -> list[dict[str, Any]]:
        """The key's records from the start of the topic to its end as of now; the follower then
        stays assigned, for ``poll_nowait``."""
        consumer = self._consumer
        tp = TopicPartition(self.topic, 0)
        with kafka_errors(f"reading {self.topic}"):
            low, high = consumer.get_watermark_offsets(tp, timeout=CONTROL_END_DEADLINE_S)
        consumer.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])
        records: list[dict[str, Any]] = []
        last = low - 1
        end = time.monotonic() + deadline_s
        while last < high - 1 and time.monotonic() < end:
            for msg in consumer.consume(500, CONTROL_READ_WAIT_S):
                if msg.error() is None:
                    last = msg.offset()
                    records += self._take(msg)
        return records

    def poll_nowait(self) -> list[dict[str, Any]]:
        """The key's records written since the last read, without waiting."""
        records: list[dict[str, Any]] = []
        for msg in self._consumer.consume(100, 0):
            if msg.error() is None:
                records += self._take(msg)
        return records

    def _take(self, msg: Any) -> list[dict[str, Any]]:
        if msg.key() != self.key or msg.value() is None:
            return []
        try:
            return [self._codec.decode_as("ControlRecord", msg.value())]
        except CodecError as exc:
            log.error("unreadable control record at %s@%d: %s", self.topic, msg.offset(), exc)
            return []

    def close(self) -> None:
        """Idempotent."""
        try:
            self._consumer.close()
        except RuntimeError:
            pass  # closed already


__all__ = ["RECEIVER_ID", "RECEIVER_KIND", "ControlFollower", "control_key", "write_desired_state"]
