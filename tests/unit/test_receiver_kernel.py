"""The receiver over the partition loop, without a broker (its offsets' rules: test_receiver_protocol.py):
a lane's inbox is bounded, a put into a full one waits, and gives up once the
lane stopped; the receiver's turn routes each record to its partition's lane and commits what is done."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from sluice.core.kafka import TopicPartition
from sluice.receiver import lanes as lanes_module
from sluice.receiver.lanes import LANE_QUEUE_MAX, Lane
from sluice.receiver.service import ReceiverService

DEADLINE_S = 10.0


class _Receiver:
    """What a lane asks of its receiver: handle one record (here: wait until released)."""

    member_id = "r"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.handled: list[Any] = []

    def _handle(self, msg: Any, lane: Any) -> None:
        self.release.wait(DEADLINE_S)
        self.handled.append(msg)


def test_a_lane_inbox_is_bounded_and_a_stopped_lane_takes_no_more(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lanes_module, "LANE_PUT_WAIT_S", 0.01)
    receiver = _Receiver()
    lane = Lane(0, receiver, None)  # type: ignore[arg-type]
    assert lane.queue.maxsize == LANE_QUEUE_MAX + 1
    for i in range(LANE_QUEUE_MAX + 2):  # one in hand, the rest queued up to the bound
        if lane.queue.full():
            break
        lane.put(i)
    assert lane.queue.full()
    waiting = threading.Thread(target=lane.put, args=("one too many",))
    waiting.start()
    lane.stop.set()  # the lane stops: the put that waited for room gives up
    waiting.join(DEADLINE_S)
    assert not waiting.is_alive()
    receiver.release.set()
    lane.close(DEADLINE_S)
    assert not lane.thread.is_alive() and "one too many" not in receiver.handled


class _Msg:
    def __init__(self, partition: int, offset: int) -> None:
        self._partition, self._offset = partition, offset

    def error(self) -> None:
        return None

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def topic(self) -> str:
        return "a.gateway.inbound"


class _Consumer:
    def __init__(self) -> None:
        self.commits: list[list[tuple[int, int]]] = []

    def commit(self, offsets: list[TopicPartition], asynchronous: bool = True) -> None:
        self.commits.append(sorted((tp.partition, tp.offset) for tp in offsets))

    def pause(self, _tps: Any) -> None: ...

    def resume(self, _tps: Any) -> None: ...


class _LaneStub:
    def __init__(self, partition: int) -> None:
        self.partition = partition
        self.got: list[Any] = []
        self.error = None
        self.paused = False
        self.queue = type("Q", (), {"qsize": staticmethod(lambda: 0)})()

    def put(self, msg: Any) -> None:
        self.got.append(msg)


def test_a_turn_routes_records_to_their_lanes_and_commits_what_is_done(tmp_path: Any) -> None:
    from test_lifecycle import _site

    from sluice.core.config import load_config

    receiver = ReceiverService(load_config(_site(tmp_path)))
    consumer = _Consumer()
    receiver._consumer = consumer  # type: ignore[assignment]
    receiver._subscribed = True  # as if the loop had joined the group (desired RUNNING)
    lanes = {0: _LaneStub(0), 1: _LaneStub(1)}
    receiver._lanes = lanes  # type: ignore[assignment]
    for part in receiver._protocol.assign([0, 1], {}, {}, now_ms=0):  # the lanes' outcomes: these offsets done
        receiver._protocol.done(part, {0: 3, 1: 9}[part.partition])
    receiver.turn([_Msg(0, 3), _Msg(1, 9), _Msg(2, 1), _Msg(0, 4)])  # partition 2 is not ours
    assert [m.offset() for m in lanes[0].got] == [3, 4] and [m.offset() for m in lanes[1].got] == [9]
    assert consumer.commits == [[(0, 3), (1, 9)]]
    receiver.turn([])
    assert consumer.commits == [[(0, 3), (1, 9)]]  # nothing new done: nothing committed again
