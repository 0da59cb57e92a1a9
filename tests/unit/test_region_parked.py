"""When a revoked bucket's kept state may serve again (engine.Parked.still_current)."""

from sluice.region.engine import Parked
from sluice.region.state import BucketState


def parked() -> Parked:
    return Parked(BucketState("orders", 3, 1, "member"), checkpoint=120, next_sequence=7, low=0, high=140)


def test_a_partition_exactly_as_it_was_keeps_the_state():
    assert parked().still_current(low=0, high=140, committed=120, transactional=True)


def test_any_record_or_marker_written_since_reloads():
    assert not parked().still_current(low=0, high=141, committed=120, transactional=True)


def test_records_deleted_from_the_start_reload():
    assert not parked().still_current(low=10, high=140, committed=120, transactional=True)


def test_another_checkpoint_or_an_unmarked_one_reloads():
    assert not parked().still_current(low=0, high=140, committed=121, transactional=True)
    assert not parked().still_current(low=0, high=140, committed=120, transactional=False)
