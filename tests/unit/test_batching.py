"""PartitionBatcher: Geode's batch-size / batch-time-interval, conflation, and identical redelivery."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.core.batching import BatchPolicy, PartitionBatcher
from sluice.core.errors import MalformedRecord


@dataclass(frozen=True)
class Item:
    offset: int
    key: str
    op: str = "UPDATE"  # CREATE, UPDATE, DESTROY

    @property
    def conflatable(self) -> bool:
        return self.op == "UPDATE"

    @property
    def size_bytes(self) -> int:
        return 10


def test_a_batch_is_ready_at_batch_size_or_after_the_interval_whichever_first() -> None:
    """batch-size events make a batch at once; fewer wait batch-time-interval from the first."""
    b = PartitionBatcher(0, BatchPolicy(batch_size=3, batch_time_interval_ms=5))
    b.add(Item(0, "a"), now_ms=100)
    b.add(Item(1, "b"), now_ms=101)
    assert not b.ready(104) and b.take(104) is None
    assert b.due_in_ms(102) == 3
    assert b.ready(105)
    b.add(Item(2, "c"), now_ms=102)
    batch = b.take(102)
    assert batch is not None and [i.offset for i in batch.events] == [0, 1, 2]
    assert batch.commit_offset == 3


def test_nothing_after_an_offered_batch_goes_first_and_a_refused_batch_is_the_same_object() -> None:
    """While a batch is out no other batch is handed out; refusal keeps the very same batch."""
    b = PartitionBatcher(0, BatchPolicy(batch_size=2, batch_time_interval_ms=0))
    for i in range(5):
        b.add(Item(i, f"k{i}"), now_ms=0)
    first = b.take(0)
    assert first is not None and [i.offset for i in first.events] == [0, 1]
    assert b.take(0) is None and not b.ready(10**6)
    again = b.rejected()
    assert again is first and again.redeliveries == 1 and b.offered is first
    assert b.accepted() == 2
    second = b.take(0)
    assert second is not None and [i.offset for i in second.events] == [2, 3]
    assert second.batch_id == first.batch_id + 1


def test_several_batches_out_are_accepted_in_order_and_a_refusal_sends_them_all_again() -> None:
    """With max_in_flight 3, three batches go out; refusal keeps all three, acceptance pops the oldest."""
    b = PartitionBatcher(0, BatchPolicy(batch_size=2, batch_time_interval_ms=0, max_in_flight=3), next_batch_id=7)
    for i in range(9):
        b.add(Item(i, f"k{i}"), now_ms=0)
    out = [b.take(0), b.take(0), b.take(0)]
    assert all(x is not None for x in out) and b.take(0) is None and b.full
    assert [x.batch_id for x in out if x] == [7, 8, 9]
    assert [[i.offset for i in x.events] for x in out if x] == [[0, 1], [2, 3], [4, 5]]
    assert b.oldest() == Item(0, "k0") and b.due_in_ms(0) is None
    assert b.rejected() is out[0] and [x.redeliveries for x in out if x] == [1, 1, 1]
    assert b.accepted() == 2 and b.offered is out[1] and not b.full
    nxt = b.take(0)
    assert nxt is not None and nxt.batch_id == 10 and [i.offset for i in nxt.events] == [6, 7]
    assert b.accepted() == 4 and b.accepted() == 6 and b.accepted() == 8 and b.out == []


def test_conflation_replaces_an_earlier_update_but_never_a_create_or_destroy() -> None:
    """An update replaces a waiting update of its key; creates and destroys stay, and break the run."""
    b = PartitionBatcher(0, BatchPolicy(batch_size=100, batch_time_interval_ms=0, conflation=True))
    seq = [Item(0, "a", "CREATE"), Item(1, "a"), Item(2, "a"), Item(3, "b"), Item(4, "a", "DESTROY"),
           Item(5, "a", "CREATE"), Item(6, "a"), Item(7, "b")]
    for it in seq:
        b.add(it, now_ms=0)
    batch = b.take(0)
    assert batch is not None
    assert [(i.key, i.op, i.offset) for i in batch.events] == [
        ("a", "CREATE", 0), ("a", "UPDATE", 2), ("b", "UPDATE", 7), ("a", "DESTROY", 4),
        ("a", "CREATE", 5), ("a", "UPDATE", 6),
    ]
    assert batch.conflated == 2 and batch.commit_offset == 8


def test_without_conflation_every_event_is_kept() -> None:
    """With conflation off, repeated updates of a key are all delivered."""
    b = PartitionBatcher(0, BatchPolicy(batch_size=100, batch_time_interval_ms=0, conflation=False))
    for i in range(4):
        b.add(Item(i, "a"), now_ms=0)
    batch = b.take(0)
    assert batch is not None and len(batch.events) == 4 and batch.conflated == 0


def test_dead_lettered_records_advance_the_commit_even_without_events() -> None:
    """Skipped (dead-lettered) offsets are covered by the next batch, or make an empty one."""
    b = PartitionBatcher(0, BatchPolicy(batch_size=10, batch_time_interval_ms=0))
    b.skip(0, now_ms=0)
    b.skip(1, now_ms=0)
    batch = b.take(0)
    assert batch is not None and batch.events == [] and batch.commit_offset == 2
    b.accepted()
    b.add(Item(2, "a"), now_ms=0)
    b.skip(3, now_ms=0)
    batch = b.take(0)
    assert batch is not None and [i.offset for i in batch.events] == [2] and batch.commit_offset == 4


@settings(max_examples=300, deadline=None, database=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["CREATE", "UPDATE", "DESTROY", "SKIP"]), st.sampled_from("abc")),
                 min_size=1, max_size=60),
    size=st.integers(min_value=1, max_value=8),
    conflation=st.booleans(),
)
def test_every_offset_is_committed_once_in_order_and_the_last_write_per_key_survives(
    ops: list[tuple[str, str]], size: int, conflation: bool
) -> None:
    """Whatever arrives: commits increase and end past the last offset, and each key's last event is delivered."""
    b = PartitionBatcher(0, BatchPolicy(batch_size=size, batch_time_interval_ms=0, conflation=conflation))
    delivered: list[Item] = []
    commits: list[int] = []
    last_by_key: dict[str, int] = {}
    for offset, (op, key) in enumerate(ops):
        if op == "SKIP":
            b.skip(offset, now_ms=0)
        else:
            b.add(Item(offset, key, op), now_ms=0)
            last_by_key[key] = offset
        batch = b.take(0)
        if batch is not None:
            assert len(batch.events) <= size
            delivered.extend(batch.events)
            commits.append(b.accepted())
    while (batch := b.take(0, force=True)) is not None:
        delivered.extend(batch.events)
        commits.append(b.accepted())
    assert commits == sorted(commits) and commits[-1] == len(ops)
    offsets = [i.offset for i in delivered]
    assert len(offsets) == len(set(offsets))
    assert set(last_by_key.values()) <= set(offsets)
    if not conflation:
        assert offsets == sorted(o for o, (op, _) in enumerate(ops) if op != "SKIP")
    per_key: dict[str, list[int]] = {}
    for i in delivered:
        per_key.setdefault(i.key, []).append(i.offset)
    for key, seen in per_key.items():
        assert seen == sorted(seen), f"key {key} out of order"


def test_rejected_without_a_batch_out_is_a_bug() -> None:
    """Calling rejected() or accepted() with no batch out is a programming error."""
    b = PartitionBatcher(0, BatchPolicy())
    with pytest.raises(AssertionError):
        b.rejected()
    with pytest.raises(AssertionError):
        b.accepted()


@pytest.mark.parametrize("conflation", [False, True])
def test_a_long_backlog_is_cut_in_linear_time_and_stays_exact(conflation: bool) -> None:
    """A 30,000-event backlog (compacted on the way) is handed out whole, in order, with exact commits."""
    import random

    rng = random.Random(5)
    b = PartitionBatcher(0, BatchPolicy(batch_size=7, batch_time_interval_ms=0, conflation=conflation))
    first = b.take(0)  # nothing yet
    assert first is None
    b.add(Item(0, "x", "CREATE"), now_ms=0)
    out = b.take(0)
    assert out is not None  # a batch is out: everything else piles up behind it
    ops = ["CREATE", "UPDATE", "UPDATE", "UPDATE", "DESTROY"]
    last_by_key: dict[str, int] = {}
    for offset in range(1, 30_000):
        key = f"k{rng.randrange(50)}"
        b.add(Item(offset, key, rng.choice(ops)), now_ms=0)
        last_by_key[key] = offset
    commits = [b.accepted()]
    delivered = []
    while (batch := b.take(0, force=True)) is not None:
        assert batch.commit_offset > commits[-1] or not batch.events
        delivered.extend(batch.events)
        commits.append(b.accepted())
        if len(commits) == 2000:
            # New events keep arriving after the backlog was compacted.
            for offset in range(30_000, 30_050):
                b.add(Item(offset, "late", "UPDATE"), now_ms=0)
                last_by_key["late"] = offset
    assert commits == sorted(commits) and commits[-1] == 30_050
    offsets = [i.offset for i in delivered]
    assert len(offsets) == len(set(offsets)) and set(last_by_key.values()) <= set(offsets)
    if not conflation:
        assert offsets == list(range(1, 30_050))


@dataclass(frozen=True)
class TxItem:
    offset: int
    key: str
    transaction: tuple[str, bool] | None = None
    conflatable: bool = False

    @property
    def size_bytes(self) -> int:
        return 10


def _tx(offset: int, tx: str | None, last: bool = False) -> TxItem:
    return TxItem(offset, f"k{offset}", None if tx is None else (tx, last))


def test_group_transaction_events_stretches_a_batch_to_the_transactions_last_event() -> None:
    """batch_size 3 would split transaction t (offsets 1..5): the batch takes all of it instead."""
    b = PartitionBatcher(0, BatchPolicy(batch_size=3, batch_time_interval_ms=0, group_transactions=True,
                                        max_in_flight=3))
    items = [_tx(0, None), *[_tx(i, "t", i == 5) for i in range(1, 6)], _tx(6, None), _tx(7, None)]
    for it in items:
        b.add(it, now_ms=0)
    first = b.take(0)
    assert first is not None and [i.offset for i in first.events] == [0, 1, 2, 3, 4, 5]
    assert first.commit_offset == 6
    second = b.take(0)
    assert second is not None and [i.offset for i in second.events] == [6, 7]


def test_an_incomplete_transaction_is_cut_off_or_held_until_its_last_event_or_the_hold_ends() -> None:
    """Events before an incomplete transaction go; the transaction waits for its last event (or the hold)."""
    policy = BatchPolicy(batch_size=10, batch_time_interval_ms=0, group_transactions=True, transaction_hold_ms=100,
                         max_in_flight=3)
    b = PartitionBatcher(0, policy)
    for it in (_tx(0, None), _tx(1, "t"), _tx(2, "t")):
        b.add(it, now_ms=0)
    before = b.take(0)
    assert before is not None and [i.offset for i in before.events] == [0]
    assert b.take(50) is None, "an incomplete transaction went out before its last event"
    b.add(_tx(3, "t", last=True), now_ms=60)
    whole = b.take(60)
    assert whole is not None and [i.offset for i in whole.events] == [1, 2, 3]
    b.add(_tx(4, "u"), now_ms=200)
    assert b.take(250) is None
    late = b.take(301)
    assert late is not None and [i.offset for i in late.events] == [4], "the hold did not end"
    b2 = PartitionBatcher(0, BatchPolicy(batch_size=2, batch_time_interval_ms=0, group_transactions=False))
    for it in (_tx(0, "t"), _tx(1, "t"), _tx(2, "t", True)):
        b2.add(it, now_ms=0)
    off = b2.take(0)
    assert off is not None and len(off.events) == 2, "without grouping, batch_size cuts a transaction"


@dataclass(frozen=True)
class Undecodable:
    """An event whose body turns out damaged when the batcher asks for what it needs."""

    offset: int
    key_reads: bool = True

    @property
    def key(self) -> str:
        if not self.key_reads:
            raise MalformedRecord("EntryEvent body of 3 bytes is truncated")
        return "a"

    @property
    def conflatable(self) -> bool:
        raise MalformedRecord("EntryEvent.operation: symbol 63 is not one of the 13")

    @property
    def transaction(self) -> tuple[str, bool] | None:
        raise MalformedRecord("EntryEvent body of 40 bytes is truncated")

    @property
    def size_bytes(self) -> int:
        return 10


@pytest.mark.parametrize("policy", [BatchPolicy(batch_size=3, batch_time_interval_ms=5, conflation=True),
                                    BatchPolicy(batch_size=3, batch_time_interval_ms=5, group_transactions=True)])
@pytest.mark.parametrize("key_reads", [True, False])
def test_an_event_that_cannot_say_what_the_batcher_asks_is_refused_whole(policy: BatchPolicy,
                                                                          key_reads: bool) -> None:
    """With conflation (key, operation) or grouped transactions (transaction), an event whose body does not
    decode makes ``add`` raise before anything changes; the caller skips its offset and the batch is exact."""
    b = PartitionBatcher(0, policy)
    b.add(Item(0, "a"), now_ms=100)
    before = (b.waiting, b.buffered_bytes, b.due_in_ms(100), b._assembling.by_key.copy())
    with pytest.raises(MalformedRecord):
        b.add(Undecodable(1, key_reads), now_ms=101)  # type: ignore[type-var]
    assert (b.waiting, b.buffered_bytes, b.due_in_ms(100), b._assembling.by_key) == before
    b.skip(1, now_ms=101)
    b.add(Item(2, "a"), now_ms=102)
    batch = b.take(105)
    assert batch is not None and batch.first_offset == 0 and batch.commit_offset == 3
    expected = [0, 2] if not policy.conflation else [2]
    assert [e.offset for e in batch.events] == expected


def test_dropping_events_from_a_batch_out_keeps_its_offsets_and_its_identity() -> None:
    """Events dead-lettered during an offer leave the batch: the same batch object goes on without them,
    holding fewer bytes, and its acceptance still commits past them."""
    b = PartitionBatcher(0, BatchPolicy(batch_size=4, batch_time_interval_ms=0))
    items = [Item(i, f"k{i}") for i in range(4)]
    for item in items:
        b.add(item, now_ms=0)
    batch = b.take(0)
    assert batch is not None and batch.nbytes == 40
    batch.drop([items[1], items[3]])
    assert b.offered is batch and [e.offset for e in batch.events] == [0, 2] and batch.nbytes == 20
    assert b.buffered_bytes == 20 and b.unaccepted == 2
    assert b.rejected() is batch and [e.offset for e in batch.events] == [0, 2]
    assert b.accepted() == 4


def test_covered_end_is_the_offset_after_everything_added_skipped_out_or_accepted() -> None:
    """covered_end follows what the batcher covers, whether assembling, out or accepted: the first offset
    it has not seen."""
    b = PartitionBatcher(0, BatchPolicy(batch_size=2, batch_time_interval_ms=0))
    assert b.covered_end == -1
    b.add(Item(5, "a"), now_ms=0)
    b.skip(6, now_ms=0)
    assert b.covered_end == 7
    batch = b.take(0)
    assert batch is not None and b.covered_end == 7
    b.accepted()
    assert b.covered_end == 7
    b.skip(9, now_ms=0)
    assert b.covered_end == 10


def test_a_clean_forgets_what_lies_below_its_offset_out_or_assembling_and_keeps_the_rest_in_order() -> None:
    """drop_below: the batches out and the events assembling below the offset are forgotten (counted); what
    lies at or after it assembles again in offset order, conflated as before; batch ids go on, and the next
    batch commits from the new start."""
    b = PartitionBatcher(0, BatchPolicy(batch_size=3, batch_time_interval_ms=0, conflation=True, max_in_flight=2))
    for i in range(6):
        b.add(Item(i, f"k{i}"), now_ms=0)
    first, second = b.take(0), b.take(0)
    assert first is not None and second is not None and len(b.out) == 2
    b.add(Item(6, "k7"), now_ms=0)
    b.add(Item(7, "k8"), now_ms=0)
    b.add(Item(8, "k7"), now_ms=0)  # conflates k7 at offset 6 away
    next_id = b.next_batch_id
    assert b.drop_below(4, now_ms=0) == 4  # offsets 0-3; 4 and 5 (batch out), 7 and 8 (assembling) stay
    assert b.out == [] and b.covered_end == 9
    again = b.take(0, force=True)
    assert again is not None and [i.offset for i in again.events] == [4, 5, 7]
    assert again.batch_id == next_id and again.first_offset == 4
    rest = b.take(0, force=True)
    assert rest is not None and [i.offset for i in rest.events] == [8] and rest.commit_offset == 9
    empty = PartitionBatcher(0, BatchPolicy())
    assert empty.drop_below(10, now_ms=0) == 0 and empty.covered_end == 10
