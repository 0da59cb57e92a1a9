"""Reading a partition whole, as services do when they take work over (their epochs, their acks, a bucket).

A read that cannot reach the end in time must say so, not end short: a sender
that rebuilt its epochs from part of its removals topic would reuse batch ids
the receiver already acknowledged, and the receiver would drop the new
batches as repeats.  A partition written in transactions (the region
changelogs, the queues) ends in markers the reader never receives: the read
still ends, at the end.
"""

from __future__ import annotations


import pytest

from sluice.core.kafka import (
    KafkaException,
    NewTopic,
    TopicPartition,
    close_producer,
    make_admin,
    make_consumer,
    make_producer,
    make_transactional_producer,
    partition_end,
    read_to_end,
    translate,
)

from waiting import wait_for


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


@pytest.mark.parametrize("last", ["commit", "abort"])
def test_a_transactional_partition_is_read_to_its_end_past_markers_and_aborted_records(site_a, unique_prefix: str,
                                                                                       last: str) -> None:
    """Markers and aborted records occupy offsets and are never delivered: a read_committed read ends
    at the partition's end all the same (comparing positions), with the committed records only, and a
    read_uncommitted one sees the aborted records too."""
    name = f"{site_a.topic_prefix(unique_prefix)}changelog"
    admin = make_admin({"bootstrap.servers": site_a.bootstrap})
    admin.create_topics([NewTopic(name, 1, 1)])[name].result(30)
    producer = make_transactional_producer({"bootstrap.servers": site_a.bootstrap}, f"{name}.writer", 10_000)
    producer.init_transactions(30)
    for what in ("commit", "abort", last):
        producer.begin_transaction()
        for i in range(3):
            producer.produce(name, f"{what}-{i}".encode(), partition=0)
        assert producer.flush(30) == 0  # an abort drops what was not sent yet: these are written, then aborted
        if what == "commit":
            producer.commit_transaction(30)
        else:
            producer.abort_transaction(30)
    close_producer(producer, 5)
    committed = make_consumer({"bootstrap.servers": site_a.bootstrap}, None, **{"fetch.wait.max.ms": 10})
    everything = make_consumer({"bootstrap.servers": site_a.bootstrap}, None,
                               **{"fetch.wait.max.ms": 10, "isolation.level": "read_uncommitted"})
    try:
        # A transaction's markers are written after its commit returns: wait until they are all there.
        wait_for(lambda: partition_end(committed, everything, TopicPartition(name, 0))[1:] == (12, 12),
                 timeout_s=10, what="9 records and 3 transaction markers at the partition's end", poll_s=0.05)
        read = [m.value() for m in read_to_end(committed, name, deadline_s=10)]
        assert read == [f"commit-{i}".encode() for i in range(3)] * (2 if last == "commit" else 1)
        assert len(list(read_to_end(everything, name, deadline_s=10))) == 9
    finally:
        committed.close()
        everything.close()
