"""The region engine's committer watchdog: a window write far past the transaction timeout stops the
engine as crashed (the process is started again) instead of holding every bucket's writes for ever."""

from __future__ import annotations

import time

import pytest

from sluice.core.errors import BrokerUnavailable
from sluice.region.engine import RegionEngine
from sluice.region.membership import WEDGED_AFTER_FACTOR


def engine_writing_for(seconds: float | None, transaction_timeout_ms: int = 10_000) -> RegionEngine:
    engine = RegionEngine.__new__(RegionEngine)
    engine._transaction_timeout_ms = transaction_timeout_ms
    engine._writing_since = None if seconds is None else time.monotonic() - seconds
    return engine


def test_a_committer_within_its_bound_or_idle_is_left_alone() -> None:
    engine_writing_for(None)._check_committer()
    engine_writing_for(WEDGED_AFTER_FACTOR * 10 - 1)._check_committer()


def test_a_committer_wedged_in_a_kafka_call_stops_the_engine() -> None:
    with pytest.raises(BrokerUnavailable, match="a Kafka call never returned"):
        engine_writing_for(WEDGED_AFTER_FACTOR * 10 + 1)._check_committer()
