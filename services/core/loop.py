"""The partition loop: one consumer in one consumer group, turned by one thread.

Every service that owns partitions of a topic through a consumer group runs
the same loop; what differs is its protocol (what records and assignments
mean, which actions follow), supplied as a ``LoopHandler``.  The kernel owns:

1. the consumer's membership: ``subscribe`` with the group callbacks, which
   librdkafka runs inside ``poll`` on the loop thread, so a handler's
   ``on_assign``/``on_revoke``/``on_lost`` never race its ``turn``;
2. the turn: at most ``read_max_records`` records, waiting at most what the
   handler's ``poll_timeout_s()`` says, handed to ``turn()`` as one list (the
   kernel does nothing per record: the hot paths stay the handler's);
3. the status timer: ``publish_status()`` after the first turn, then every
   ``status_interval_s``;
4. crash propagation: the loop runs inside the service's ``crash_guard``
   (core/lifecycle.py) and raises, at every turn, a crash a worker thread
   recorded (``raise_crash``), so a dying worker ends the loop as crashed;
5. the ``Inbox``: the one bounded way from worker threads to the loop.  A
   worker waits for room (back-pressure, never an unbounded backlog), and a
   stop ends that wait with ``Stopping``, so a worker never outlives the loop
   on a full inbox.  The loop thread itself never puts into it (it would wait
   for itself).

The caller releases what it owns in a ``finally`` after ``run()`` (close the
consumer, which revokes; then workers, producer, followers), in that order.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Generic, Protocol, TypeVar

from .errors import Stopping
from .kafka import Consumer, Message, TopicPartition, consume_available, kafka_errors
from .lifecycle import Service

T = TypeVar("T")

#: How long a worker waits for room in a full inbox before it looks whether the service stops.
INBOX_PUT_WAIT_S = 0.1


class Inbox(Generic[T]):
    """A bounded queue from worker threads to the loop thread (step 5 of the module docstring)."""

    def __init__(self, maxsize: int, stopping: threading.Event, what: str) -> None:
        if maxsize < 1:
            raise ValueError(f"the inbox of {what} needs room for one item at least (maxsize {maxsize})")
        self.maxsize = maxsize
        self.what = what
        self._queue: queue.Queue[T] = queue.Queue(maxsize=maxsize)
        self._stopping = stopping

    def put(self, item: T) -> None:
        """Worker thread: wait for room; ``Stopping`` when the service stops while the inbox is full."""
        while True:
            try:
                self._queue.put(item, timeout=INBOX_PUT_WAIT_S)
                return
            except queue.Full:
                if self._stopping.is_set():
                    raise Stopping(f"waiting for room in the inbox of {self.what}") from None

    def get(self, timeout_s: float) -> T | None:
        """Loop thread: the next item, waiting at most ``timeout_s``; None when none came."""
        try:
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def get_nowait(self) -> T:
        return self._queue.get_nowait()

    def drain(self) -> list[T]:
        """Loop thread: every item there now, oldest first."""
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def empty(self) -> bool:
        return self._queue.empty()

    def qsize(self) -> int:
        return self._queue.qsize()


class LoopHandler(Protocol):
    """What a service supplies to the partition loop (its protocol's I/O face)."""

    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None: ...

    def on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None: ...

    def on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None: ...

    def poll_timeout_s(self) -> float:
        """How long the next poll may wait for records."""
        ...

    def turn(self, msgs: list[Message]) -> None:
        """One turn: the records of one poll (possibly none), then whatever follows from them and
        from the inbox."""
        ...

    def publish_status(self) -> None: ...


class PartitionLoop:
    """The loop of one consumer for ``service`` over ``topics`` (module docstring)."""

    def __init__(self, service: Service, consumer: Consumer, topics: list[str], handler: LoopHandler, *,
                 read_max_records: int, status_interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if read_max_records < 1:
            raise ValueError(f"read_max_records must be at least 1 (got {read_max_records})")
        self.service = service
        self.consumer = consumer
        self.topics = topics
        self.handler = handler
        self.read_max_records = read_max_records
        self.status_interval_s = status_interval_s
        #: Monotonic seconds, for the status timer (a test drives its own).
        self.clock = clock

    def subscribe(self) -> None:
        handler = self.handler
        with kafka_errors(f"subscribing to {', '.join(self.topics)}"):
            self.consumer.subscribe(self.topics, on_assign=handler.on_assign, on_revoke=handler.on_revoke,
                                    on_lost=handler.on_lost)

    def run(self) -> None:
        """Turn until the service stops or crashes (a crash is recorded and raised)."""
        service, consumer, handler = self.service, self.consumer, self.handler
        stopping = service.stopping
        consuming = kafka_errors(f"consuming {', '.join(self.topics)}")
        clock = self.clock
        next_status = clock()  # the first turn publishes: a new member says where it stands at once
        with service.crash_guard():
            while not stopping.is_set():
                with consuming:
                    msgs = consume_available(consumer, self.read_max_records, handler.poll_timeout_s())
                handler.turn(msgs)
                service.raise_crash()
                if clock() >= next_status:
                    handler.publish_status()
                    next_status = clock() + self.status_interval_s
            # A worker's crash also sets the stop flag: the loop ends, and ends raising it.
            service.raise_crash()


__all__ = ["INBOX_PUT_WAIT_S", "Inbox", "LoopHandler", "PartitionLoop"]
