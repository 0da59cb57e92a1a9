"""The status page's sampler (``sluice admin serve``) lives on the core lifecycle: ``stop()`` is
idempotent, from any thread, and runs its stop once; a stopped sampler is never started again; a bug
that kills the sampler thread is kept as the sampler's crash, ends its wait flag, and is shown by the
page's /healthz (503 with the crash), never logged and forgotten.  No broker: the Kafka admin client is
a recording stand-in and the site's sample is replaced."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from starlette.testclient import TestClient

from sluice.admin import serve
from sluice.core.config import parse_config
from sluice.core.errors import IllegalTransition, SluiceError
from sluice.core.lifecycle import ServiceState

#: A bound on every wait: a condition that never comes fails the test, never hangs it.
DEADLINE_S = 10.0

SITE = {"site": "a", "dsid": 1, "kafka": {"bootstrap_servers": "127.0.0.1:9092"},
        "regions": [{"name": "orders", "buckets": 4}]}


class BrokerAway(SluiceError):
    """What a sample raises while the broker cannot be reached: the page shows stale tables, no crash."""


def broker_away(*_: Any) -> dict[str, Any]:
    raise BrokerAway("broker away")


def sampler() -> serve.StatusSampler:
    return serve.StatusSampler(parse_config(SITE, source="site.yaml"), interval_s=0.5, history_s=10,
                               token_required=False)


def test_stop_is_idempotent_from_any_thread_and_a_stopped_sampler_stays_stopped(
        monkeypatch: pytest.MonkeyPatch, recorded: list[tuple[str, dict[str, Any]]]) -> None:
    """A running sampler stopped by several threads at once and again afterwards ends STOPPED, its
    thread ended, with no crash; its stop ran once; starting it again is refused."""
    sampled = threading.Event()

    def sample(*_: Any) -> dict[str, Any]:
        sampled.set()
        raise BrokerAway("broker away")

    monkeypatch.setattr(serve.statusdoc, "sample", sample)
    page = sampler()
    stops: list[int] = []
    on_stop = page.on_stop
    monkeypatch.setattr(page, "on_stop", lambda: (stops.append(1), on_stop()))
    page.start()
    assert page.state is ServiceState.RUNNING
    assert sampled.wait(DEADLINE_S), "the sampler never sampled"
    callers = [threading.Thread(target=page.stop) for _ in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(DEADLINE_S)
    page.stop()
    assert page.state is ServiceState.STOPPED and page.crash is None
    assert stops == [1]
    assert page._thread is not None and not page._thread.is_alive()
    assert [kind for kind, _ in recorded] == ["RecordedAdmin"], "the sampler's admin client was not made once"
    assert b"BrokerAway: broker away" in page.status_json, "a broker away is shown on the page"
    with pytest.raises(IllegalTransition):
        page.start()


def test_a_sampler_stopped_before_it_started_is_stopped_and_never_starts() -> None:
    """NEW → STOPPED on stop(), nothing opened; a second stop does nothing; start is refused."""
    page = sampler()
    page.stop()
    page.stop()
    assert page.state is ServiceState.STOPPED
    with pytest.raises(IllegalTransition):
        page.start()


def test_a_crash_of_the_sampler_thread_is_its_state_its_crash_and_its_health(
        monkeypatch: pytest.MonkeyPatch, recorded: list[tuple[str, dict[str, Any]]]) -> None:
    """A bug in a sample (not a SluiceError, which the page shows as stale) kills the thread: the sampler
    goes CRASHED with that exception, its stop flag is set (what ends the page's server), a later stop
    keeps it CRASHED, and /healthz answers 503 naming the crash."""
    bug = ZeroDivisionError("a bug in the sample")

    def sample(*_: Any) -> dict[str, Any]:
        raise bug

    monkeypatch.setattr(serve.statusdoc, "sample", sample)
    page = sampler()
    page.start()
    assert page.stopping.wait(DEADLINE_S), "the crash did not set the sampler's stop flag"
    assert page.state is ServiceState.CRASHED
    assert page.crash is bug
    with TestClient(serve.create_app(page, None)) as client:
        answer = client.get("/healthz")
    assert answer.status_code == 503
    assert answer.json() == {"state": "crashed", "crash": repr(bug)}
    page.stop()
    page.stop()
    assert page.state is ServiceState.CRASHED and page.crash is bug


def test_healthz_answers_200_while_the_sampler_runs(monkeypatch: pytest.MonkeyPatch,
                                                     recorded: list[tuple[str, dict[str, Any]]]) -> None:
    """Alive: a sampler whose broker is away still runs (the page shows stale tables)."""
    monkeypatch.setattr(serve.statusdoc, "sample", broker_away)
    page = sampler()
    page.start()
    try:
        with TestClient(serve.create_app(page, None)) as client:
            answer = client.get("/healthz")
        assert answer.status_code == 200 and answer.json() == {"state": "running"}
    finally:
        page.stop()
    assert page.state is ServiceState.STOPPED
