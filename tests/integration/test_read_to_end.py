"""Reading a small topic whole, as services do when they take work over (their epochs, their acks).

A read that cannot reach the end in time must say so, not end short: a sender
that rebuilt its epochs from part of its removals topic would reuse batch ids
the receiver already acknowledged, and the receiver would drop the new
batches as repeats.
"""

from __future__ import annotations

import pytest

from sluice.core.kafka import KafkaException, NewTopic, make_admin, make_consumer, make_producer, read_to_end, translate


@pytest.fixture
def topic(site_a, unique_prefix: str) -> str:
    name = f"{site_a.topic_prefix(unique_prefix)}removals"
    admin = make_admin({"bootstrap.servers": site_a.bootstrap})
    admin.create_topics([NewTopic(name, 1, 1)])[name].result(30)
    producer = make_producer({"bootstrap.servers": site_a.bootstrap})
    for i in range(20):
        producer.produce(name, b"%d" % i, b"%d" % (i % 4))
    assert producer.flush(30) == 0
    return name


def test_a_read_gives_every_record_to_the_end(site_a, topic: str) -> None:
    consumer = make_consumer({"bootstrap.servers": site_a.bootstrap}, None, **{"fetch.wait.max.ms": 10})
    try:
        assert [m.value() for m in read_to_end(consumer, topic)] == [b"%d" % i for i in range(20)]
    finally:
        consumer.close()


def test_a_read_that_misses_its_deadline_raises_a_retriable_error_instead_of_ending_short(site_a, topic: str) -> None:
    consumer = make_consumer({"bootstrap.servers": site_a.bootstrap}, None, **{"fetch.wait.max.ms": 10})
    try:
        read: list[bytes | None] = []
        with pytest.raises(KafkaException) as caught:
            for msg in read_to_end(consumer, topic, deadline_s=0):
                read.append(msg.value())
        assert read == []
        error = translate(caught.value, "reading the removals")
        assert error.retriable
        assert f"{topic}[0] reached offset 0 of 20" in str(error)
    finally:
        consumer.close()
