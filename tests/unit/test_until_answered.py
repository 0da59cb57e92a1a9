"""core.kafka.until_answered: a read the service cannot go on without, asked again while the broker
does not answer, never ended by a retriable error."""

from __future__ import annotations

import threading

import pytest

from sluice.core import kafka
from sluice.core.errors import SluiceError, Stopping
from sluice.core.kafka import KafkaError, KafkaException, until_answered


@pytest.fixture(autouse=True)
def _no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka, "ASK_AGAIN_AFTER_S", 0.0)


def _failing(times: int, code: int) -> tuple[list[int], object]:
    calls: list[int] = []

    def ask() -> int:
        calls.append(1)
        if len(calls) <= times:
            raise KafkaException(KafkaError(code))
        return 42

    return calls, ask


@pytest.mark.parametrize("code", [KafkaError._UNKNOWN_PARTITION, KafkaError._TIMED_OUT, KafkaError._TRANSPORT])
def test_a_broker_that_does_not_answer_is_asked_again_until_it_does(code: int,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    calls, ask = _failing(3, code)
    assert until_answered(ask, "reading the end of q[0]", stopping=threading.Event()) == 42
    assert len(calls) == 4
    assert sum("reading the end of q[0]" in r.getMessage() and "asking again" in r.getMessage()
               for r in caplog.records) == 3


def test_a_failure_asking_again_cannot_mend_is_raised_as_a_sluice_error_naming_the_read() -> None:
    calls, ask = _failing(1, KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with pytest.raises(SluiceError, match="reading the end of q"):
        until_answered(ask, "reading the end of q[0]", stopping=threading.Event())
    assert len(calls) == 1


def test_a_stopping_service_is_not_kept_waiting() -> None:
    stopping = threading.Event()
    stopping.set()
    calls, ask = _failing(100, KafkaError._TRANSPORT)
    with pytest.raises(Stopping):
        until_answered(ask, "reading the end of q[0]", stopping=stopping)
    assert len(calls) == 1
