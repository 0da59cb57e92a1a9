"""The receiver's screening settings, and ``region_service.max_clock_skew_ms``, act with values other
than their defaults: which sites' batches are taken, how old or how far in the future a batch or an
event may be.  No broker is needed: the checks are the receiver's and the region service's own."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from sluice.core.config import SiteConfig, parse_config
from sluice.core.errors import RejectedBatch, StaleBatch
from sluice.core.eventchecks import remote_problem
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.receiver.service import ReceiverService

NOW_MS = 1_700_000_000_000


def site(**receiver: Any) -> SiteConfig:
    return parse_config({"site": "b", "dsid": 2, "kafka": {"bootstrap_servers": "k:9092"},
                         "regions": [{"name": "orders", "buckets": 2}],
                         "region_service": {"max_clock_skew_ms": 5000},
                         "receiver": {"accepted_dsids": [1, 3], "batch_max_age_ms": 600_000, **receiver}})


def batch(source: int = 1, created_at: int = NOW_MS) -> Any:
    return SimpleNamespace(source_dsid=source, target_dsid=2, batch_id=7, created_at=created_at)


def test_a_receiver_takes_batches_only_from_accepted_sites_within_its_age_and_skew_bounds() -> None:
    """accepted_dsids [1, 3]: dsid 4's batch is rejected; batch_max_age_ms 600000: a batch sent 11
    minutes ago is a replay, one sent 9 minutes ago is not; max_clock_skew_ms 5000: a batch stamped 6 s
    ahead is refused, one 4 s ahead taken."""
    receiver = ReceiverService(site())
    assert receiver._batch_problem(batch(), None, NOW_MS) is None
    assert receiver._batch_problem(batch(source=3), None, NOW_MS) is None
    rejected = receiver._batch_problem(batch(source=4), None, NOW_MS)
    assert isinstance(rejected, RejectedBatch) and "accepted dsids are [1, 3]" in str(rejected)

    assert receiver._batch_problem(batch(created_at=NOW_MS - 540_000), None, NOW_MS) is None
    old = receiver._batch_problem(batch(created_at=NOW_MS - 660_000), None, NOW_MS)
    assert isinstance(old, StaleBatch) and "batch_max_age_ms=600000" in str(old)

    assert receiver._batch_problem(batch(created_at=NOW_MS + 4000), None, NOW_MS) is None
    ahead = receiver._batch_problem(batch(created_at=NOW_MS + 6000), None, NOW_MS)
    assert isinstance(ahead, StaleBatch) and "max_clock_skew_ms=5000" in str(ahead)


def remote(timestamp: int) -> EntryEvent:
    return EntryEvent(region="orders", key="k", operation=Operation.UPDATE, value=b"1",
                      event_id=EventID("m", 1, 1), version=VersionTag(1, timestamp, 1, "m"),
                      origin_dsid=1, bucket=0, event_time=timestamp)


def test_max_clock_skew_is_how_far_ahead_another_sites_event_may_be_stamped() -> None:
    """With max_clock_skew_ms 5000 an event from another site stamped 4 s ahead applies and one stamped
    6 s ahead is refused (it would win every conflict on its key); with the default 60000 both apply."""
    skewed = site()
    assert remote_problem(skewed, remote(NOW_MS + 4000), NOW_MS) is None
    problem = remote_problem(skewed, remote(NOW_MS + 6000), NOW_MS)
    assert problem is not None and problem.field == "event.version.timestamp"
    assert "beyond max_clock_skew_ms=5000" in problem.reason
    default = skewed.with_overrides({"region_service": {"max_clock_skew_ms": 60_000}})
    assert remote_problem(default, remote(NOW_MS + 6000), NOW_MS) is None
