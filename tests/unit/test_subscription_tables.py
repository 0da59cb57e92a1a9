"""The subscription service reading its tables' ends at start: a retriable Kafka failure (a partition's
leader still moving after the topics were made) is tried again within READ_TABLES_S, any other is
raised at once, never retried."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import KafkaError, KafkaException

from sluice.core.errors import BrokerUnavailable
from sluice.core.kafka import TopicPartition
from sluice.subscriptions import tables as tables_module
from sluice.subscriptions.service import SubscriptionService
from test_subscription_settings import site


class Tables:
    """A table consumer whose first ``failures`` watermark reads fail with ``code``."""

    def __init__(self, code: int, failures: int) -> None:
        self.code, self.failures, self.calls = code, failures, 0

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float) -> tuple[int, int]:
        self.calls += 1
        if self.calls <= self.failures:
            raise KafkaException(KafkaError(self.code, "Failed to get watermark offsets"))
        return 0, 42


def service_with(tables: Tables) -> SubscriptionService:
    service = SubscriptionService(site(), member_id="m1")
    service._tables = tables  # type: ignore[assignment]
    return service


def test_a_leader_moving_is_tried_again_until_the_end_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tables_module, "READ_TABLES_RETRY_S", 0.001)
    tables = Tables(KafkaError.NOT_LEADER_FOR_PARTITION, failures=3)
    end = service_with(tables).tables.end(TopicPartition("t", 0), time.monotonic() + 30)
    assert (end, tables.calls) == (42, 4)


def test_a_non_retriable_failure_is_raised_at_once() -> None:
    tables = Tables(KafkaError.TOPIC_AUTHORIZATION_FAILED, failures=1)
    with pytest.raises(BrokerUnavailable) as raised:
        service_with(tables).tables.end(TopicPartition("t", 0), time.monotonic() + 30)
    assert not raised.value.retriable and tables.calls == 1


def test_a_retriable_failure_past_the_deadline_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tables_module, "READ_TABLES_RETRY_S", 0.001)
    tables = Tables(KafkaError.LEADER_NOT_AVAILABLE, failures=10**6)
    with pytest.raises(BrokerUnavailable) as raised:
        service_with(tables).tables.end(TopicPartition("t", 0), time.monotonic() + 0.05)
    assert raised.value.retriable and tables.calls > 1
