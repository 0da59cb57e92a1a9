"""The partition-loop kernel (core/loop.py) without a broker: it subscribes with the handler's group
callbacks, hands each poll to ``turn`` as one list, publishes status on its timer, ends on a stop, ends
as crashed when a worker thread dies; its inbox is bounded, a full one makes a worker wait, and a stop
ends that wait with ``Stopping``."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from sluice.core.errors import Stopping
from sluice.core.lifecycle import Service, ServiceState
from sluice.core.loop import Inbox, PartitionLoop

DEADLINE_S = 10.0


class FakeConsumer:
    """Hands out the prepared polls, then nothing."""

    def __init__(self, polls: list[list[Any]]) -> None:
        self.polls = polls
        self.subscribed: tuple[list[str], dict[str, Any]] | None = None
        self.asked: list[int] = []

    def subscribe(self, topics: list[str], **callbacks: Any) -> None:
        self.subscribed = (topics, callbacks)

    def poll(self, timeout: float) -> Any:
        """The first record of the next prepared poll (the rest come from ``consume``)."""
        self._rest = self.polls.pop(0) if self.polls else []
        return self._rest.pop(0) if self._rest else None

    def consume(self, num_messages: int, timeout: float) -> list[Any]:
        self.asked.append(num_messages + 1)
        rest, self._rest = self._rest[:num_messages], []
        return rest


class Message:
    def error(self) -> None:
        return None


class Handler(Service):
    """A service that is its own loop handler, stopping itself after ``turns_max`` turns."""

    kind = "test"

    def __init__(self, turns_max: int) -> None:
        super().__init__()
        self.turns: list[int] = []
        self.statuses = 0
        self.turns_max = turns_max

    def on_assign(self, consumer: Any, partitions: list[Any]) -> None: ...

    def on_revoke(self, consumer: Any, partitions: list[Any]) -> None: ...

    def on_lost(self, consumer: Any, partitions: list[Any]) -> None: ...

    def poll_timeout_s(self) -> float:
        return 0.0

    def turn(self, msgs: list[Any]) -> None:
        self.turns.append(len(msgs))
        if len(self.turns) >= self.turns_max:
            self.stop()

    def publish_status(self) -> None:
        self.statuses += 1


def test_the_loop_hands_each_poll_to_turn_and_publishes_status() -> None:
    handler = Handler(turns_max=4)
    handler._set_running()
    consumer = FakeConsumer([[Message(), Message()], [], [Message()]])
    loop = PartitionLoop(handler, consumer, ["t"], handler, read_max_records=7, status_interval_s=0.0)
    loop.subscribe()
    assert consumer.subscribed is not None
    topics, callbacks = consumer.subscribed
    assert topics == ["t"] and set(callbacks) == {"on_assign", "on_revoke", "on_lost"}
    loop.run()
    assert handler.turns == [2, 0, 1, 0]
    assert set(consumer.asked) == {7}  # never more than read_max_records a poll
    assert handler.statuses >= 3 and handler.state is ServiceState.STOPPING


def test_a_dead_worker_ends_the_loop_as_crashed() -> None:
    handler = Handler(turns_max=10**9)
    handler._set_running()
    loop = PartitionLoop(handler, FakeConsumer([]), ["t"], handler, read_max_records=1, status_interval_s=60)
    failure = RuntimeError("worker died")

    def worker() -> None:
        raise failure

    handler.spawn(worker, "worker").join(DEADLINE_S)
    with pytest.raises(RuntimeError):
        loop.run()
    assert handler.state is ServiceState.CRASHED and handler.crash is failure


def test_the_inbox_is_bounded_and_a_stop_ends_a_wait_for_room() -> None:
    stopping = threading.Event()
    inbox: Inbox[int] = Inbox(2, stopping, "a test queue")
    inbox.put(1)
    inbox.put(2)
    outcome: list[BaseException] = []

    def worker() -> None:
        try:
            inbox.put(3)
        except Stopping as exc:
            outcome.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join(0.3)
    assert t.is_alive() and inbox.qsize() == 2  # waiting for room, not past the bound
    stopping.set()
    t.join(DEADLINE_S)
    assert not t.is_alive() and len(outcome) == 1
    assert inbox.drain() == [1, 2] and inbox.get(0.0) is None


def test_the_inbox_hands_room_back_to_a_waiting_worker() -> None:
    inbox: Inbox[int] = Inbox(1, threading.Event(), "a test queue")
    inbox.put(1)
    t = threading.Thread(target=inbox.put, args=(2,))
    t.start()
    assert inbox.get(DEADLINE_S) == 1
    t.join(DEADLINE_S)
    assert inbox.get(DEADLINE_S) == 2


def test_an_inbox_without_room_is_refused() -> None:
    with pytest.raises(ValueError, match="room for one item"):
        Inbox(0, threading.Event(), "a test queue")


@pytest.mark.parametrize("kind, field, value", [
    ("async_event_queues", "batch_size", 10_001),
    ("gateway_senders", "batch_size", 10_001),
    ("async_event_queues", "batch_time_interval_ms", 600_001),
    ("gateway_senders", "maximum_queue_memory_mb", 65_537),
])
def test_what_sizes_a_queue_loop_is_bounded_at_configuration_time(tmp_path: Any, kind: str, field: str,
                                                                   value: int) -> None:
    """A batch, its wait and a primary's memory have upper bounds: a site file beyond one is refused,
    naming the setting (the loop's inbox is sized from the batch)."""
    import yaml

    from sluice.core.config import load_config
    from sluice.core.errors import ConfigError

    queue: dict[str, Any] = {"id": "q", field: value}
    if kind == "async_event_queues":
        queue["listener"] = {"type": "sql", "settings": {}}
    else:
        queue["remote_dsid"] = 2
    def site(value: int) -> Any:
        path = tmp_path / "site.yaml"
        path.write_text(yaml.safe_dump({
            "site": "a", "dsid": 1, "kafka": {"bootstrap_servers": "127.0.0.1:9", "topic_prefix": "a."},
            "regions": [{"name": "orders", "buckets": 2, kind: ["q"]}],
            kind: [{**queue, field: value}]}))
        return path

    load_config(site(value - 1))  # the bound itself is accepted
    with pytest.raises(ConfigError) as refused:
        load_config(site(value))
    assert f"{kind}[0].{field}" in str(refused.value)
