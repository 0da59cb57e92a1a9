"""The ``Service`` base (core/lifecycle.py) without a broker: only the drawn moves are made (a second
start, a start after a stop raise ``IllegalTransition``), ``stop()`` is idempotent from any thread and
runs ``on_stop()`` once, a crashed worker thread's exception becomes the service's state, its crash and
its health, and is raised by the owner's loop, and a ``Stopping`` that leaves a loop is no crash."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import yaml

from sluice.core.config import load_config
from sluice.core.errors import IllegalTransition, Stopping
from sluice.core.health import liveness, readiness
from sluice.core.lifecycle import TRANSITIONS, Service, ServiceState

#: A bound on every wait of these tests: a condition that never comes fails the test, never hangs it.
DEADLINE_S = 10.0


class Loop(Service):
    """A service whose loop runs until it is stopped or a worker raises (the shape of every loop service)."""

    kind = "test-loop"

    def __init__(self) -> None:
        super().__init__()
        self.stops = 0
        self.turns = 0
        self.released = False

    def start(self) -> None:
        self._check_startable()
        self._set_running()

    def run(self) -> None:
        try:
            with self.crash_guard():
                while not self._stopping.wait(0.001):
                    self.turns += 1
                    self.raise_crash()
                self.raise_crash()
        finally:
            self.released = True
            self._set_stopped()

    def on_stop(self) -> None:
        self.stops += 1


def test_only_the_drawn_moves_are_made() -> None:
    assert TRANSITIONS[ServiceState.STOPPED] == frozenset() == TRANSITIONS[ServiceState.CRASHED]
    service = Loop()
    service.start()
    with pytest.raises(IllegalTransition) as raised:
        service.start()
    assert (raised.value.current, raised.value.wanted) == ("running", "running")
    assert not raised.value.retriable
    service.stop()
    with pytest.raises(IllegalTransition):
        service.start()  # a stopped service is never started again
    assert service.state is ServiceState.STOPPING


def test_stop_before_start_is_a_stop() -> None:
    service = Loop()
    service.stop()
    assert service.state is ServiceState.STOPPED
    assert service.stopping.is_set()
    with pytest.raises(IllegalTransition):
        service.start()


def test_stop_is_idempotent_from_many_threads() -> None:
    service = Loop()
    service.start()
    runner = threading.Thread(target=service.run)
    runner.start()
    stoppers = [threading.Thread(target=service.stop) for _ in range(8)]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join(DEADLINE_S)
    runner.join(DEADLINE_S)
    assert not runner.is_alive()
    assert service.stops == 1
    assert service.state is ServiceState.STOPPED and service.crash is None and service.released
    service.stop()
    assert service.stops == 1 and service.state is ServiceState.STOPPED


def test_a_crashed_worker_crashes_the_service_and_its_loop() -> None:
    service = Loop()
    service.start()
    failure = RuntimeError("the ack reader broke")

    def worker() -> None:
        raise failure

    runner = threading.Thread(target=lambda: pytest.raises(RuntimeError, service.run))
    runner.start()
    service.spawn(worker, name="worker").join(DEADLINE_S)
    runner.join(DEADLINE_S)
    assert not runner.is_alive()
    assert service.state is ServiceState.CRASHED and service.crash is failure and service.released
    alive, body = liveness(service)
    assert not alive and body["crash"] == repr(failure)
    ready, body = readiness(service)
    assert not ready and body["state"] == "crashed"
    # The first crash wins; a stop afterwards keeps CRASHED (and still releases, once).
    assert not service.record_crash(ValueError("later"))
    service.stop()
    assert service.state is ServiceState.CRASHED and service.crash is failure and service.stops == 1


def test_an_exception_leaving_the_loop_is_the_crash() -> None:
    service = Loop()
    service.start()
    failure = ValueError("a bug in the loop")
    with pytest.raises(ValueError):
        with service.crash_guard():
            raise failure
    assert service.state is ServiceState.CRASHED and service.crash is failure
    assert service.stopping.is_set()  # every wait of the service ends


def test_a_stop_that_leaves_a_wait_is_no_crash() -> None:
    service = Loop()
    service.start()
    service.stop()
    with service.crash_guard():
        raise Stopping("waiting for the broker")
    service._set_stopped()
    assert service.state is ServiceState.STOPPED and service.crash is None


def test_a_keyboard_interrupt_is_the_operators_not_a_crash() -> None:
    service = Loop()
    service.start()
    with pytest.raises(KeyboardInterrupt):
        with service.crash_guard():
            raise KeyboardInterrupt
    assert service.state is ServiceState.RUNNING and service.crash is None


class Listener:
    """The listener the test site's queue names (never offered anything here)."""

    def init(self, _properties: dict[str, str]) -> None:
        pass

    def process_events(self, _events: list[object]) -> bool:
        return True

    def close(self) -> None:
        pass


def _site(tmp_path: Path) -> Path:
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump({
        "site": "a", "dsid": 1, "kafka": {"bootstrap_servers": "127.0.0.1:9", "topic_prefix": "a."},
        "regions": [{"name": "orders", "buckets": 2, "async_event_queues": ["q"]}],
        "async_event_queues": [{"id": "q", "parallel": True, "batch_size": 100,
                                "listener": {"type": "python", "class_path": "test_lifecycle:Listener"}}],
        "receiver": {"accepted_dsids": [2]},
        "region_service": {"allow_unauthenticated": True},
    }))
    return path


def test_every_service_runs_the_one_lifecycle(tmp_path: Path) -> None:
    """The queue primaries, the receiver, the subscription and region services are ``Service``s: a stop
    before start is STOPPED, and none of them can then be started."""
    from sluice.dispatcher.service import DispatcherService
    from sluice.receiver.service import ReceiverService
    from sluice.region.service import RegionService
    from sluice.sender.service import GatewaySenderService
    from sluice.subscriptions.service import SubscriptionService

    assert all(issubclass(c, Service) for c in (DispatcherService, GatewaySenderService, ReceiverService,
                                                SubscriptionService, RegionService))
    cfg = load_config(_site(tmp_path))
    for service in (DispatcherService(cfg, "q"), ReceiverService(cfg), SubscriptionService(cfg)):
        assert service.state is ServiceState.NEW
        service.stop()
        service.stop()
        assert service.state is ServiceState.STOPPED
        with pytest.raises(IllegalTransition):
            service.start()


def test_every_move_goes_through_the_table() -> None:
    """Not only ``start()``: a move the table does not hold raises wherever it is asked for."""
    service = Loop()
    service._set_running()
    with pytest.raises(IllegalTransition) as raised:
        service._set_running()
    assert (raised.value.current, raised.value.wanted) == ("running", "running")
    service.stop()
    service._set_stopped()
    with pytest.raises(IllegalTransition) as raised:
        service._set_running()
    assert (raised.value.current, raised.value.wanted) == ("stopped", "running")
    assert service.state is ServiceState.STOPPED
