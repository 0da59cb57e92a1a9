"""The region loader's watch on transactions the broker never ends (engine.HangingWatch)."""

from sluice.region.engine import HangingWatch


def test_an_open_transaction_is_reported_once_when_it_outlives_any_producers_timeout():
    watch = HangingWatch(hanging_after_s=40.0)
    assert watch.seen_open("orders", 1, 1451, now=100.0) is None
    assert watch.seen_open("orders", 1, 1451, now=139.0) is None
    assert watch.hanging(now=139.0) == []
    assert watch.seen_open("orders", 1, 1451, now=141.0) == 41.0
    assert watch.seen_open("orders", 1, 1451, now=200.0) is None  # reported already
    assert watch.hanging(now=200.0) == [("orders", 1, 1451, 100.0)]


def test_a_transaction_that_ends_is_not_hanging_and_a_later_one_is_timed_afresh():
    watch = HangingWatch(hanging_after_s=40.0)
    watch.seen_open("orders", 1, 10, now=0.0)
    # the first transaction ended; another is open from a later offset
    assert watch.seen_open("orders", 1, 12, now=50.0) is None
    assert watch.hanging(now=60.0) == []
    assert watch.seen_open("orders", 1, 12, now=95.0) == 45.0


def test_a_loaded_or_lost_bucket_is_forgotten():
    watch = HangingWatch(hanging_after_s=1.0)
    watch.seen_open("orders", 1, 5, now=0.0)
    watch.seen_open("orders", 2, 7, now=0.0)
    watch.clear("orders", 1)
    assert watch.hanging(now=10.0) == [("orders", 2, 7, 10.0)]
    watch.clear("orders", 2)
    assert watch.hanging(now=10.0) == []
