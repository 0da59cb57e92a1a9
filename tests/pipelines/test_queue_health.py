"""Queue health on a real broker and a local Spark: known enqueues and removals give known rates and waits."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from sluice.cli import main as sluice_main
from sluice.pipelines.queue_health import parse_since

from pipelinekit import encode, entry_event, produce, write_site

pytestmark = pytest.mark.timeout(240)

#: The first minute of the test's queue: a whole minute, an hour ago.
M0 = (int(dt.datetime.now(dt.timezone.utc).timestamp()) // 60 - 60) * 60_000
MINUTE = 60_000


def _queued(cfg: Any, partition: int, offset_like: int, enqueued_at: int) -> bytes:
    event = entry_event("orders", f"key-{partition}-{offset_like}", offset_like, buckets=2)
    return encode("QueuedEvent", {"queue_id": "to-b", "changelog_partition": partition,
                                  "changelog_offset": offset_like, "enqueued_at": enqueued_at,
                                  "event": event.to_record()})


def _removal(partition: int, batch: int, last_removed_offset: int, removed_at: int) -> bytes:
    return encode("RemovalRecord", {"queue_id": "to-b", "queue_partition": partition, "batch_id": batch,
                                    "last_removed_offset": last_removed_offset, "last_event_id": None,
                                    "removed_count": 0, "removed_at": removed_at})


def test_queue_health_counts_enqueues_removals_and_waits_per_minute(spark: Any, site_a: Any, unique_prefix: str,
                                                                   tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Partition 0 gets 6 events in minute 0, removed in two batches in minute 1 (waits 60-65 s and
    70-72 s); partition 1 gets 3 events in minute 1 that are never removed.  The table says exactly that
    per minute (enqueued, removed, backlog, pending, wait p50 and max), the corrupt queue record is
    counted apart, and the chart is a PNG."""
    cfg = write_site(tmp_path / "site.yaml", site="a", dsid=1, bootstrap=site_a.bootstrap,
                     prefix=site_a.topic_prefix(unique_prefix), regions={"orders": 2}, sender="to-b")
    queue, removals = cfg.topics.queue("to-b"), cfg.topics.removals("to-b")
    enqueued_0 = [M0 + 1000 * i for i in range(6)]  # offsets 0..5 of partition 0, in minute 0
    records = [(queue, b"k", _queued(cfg, 0, i, at), 0) for i, at in enumerate(enqueued_0)]
    records += [(queue, b"k", _queued(cfg, 1, i, M0 + MINUTE + 5000 + i), 1) for i in range(3)]
    records.append((queue, b"k", b"\xc3\x01 truncated", 1))
    # Offsets 0..2 removed at M0+65 s, then 3..5 at M0+75 s (and the epoch record of a restarted sender
    # repeating the head later, which removes nothing).
    records += [(removals, b"0", _removal(0, 1, 2, M0 + 65_000), 0),
                (removals, b"0", _removal(0, 2, 5, M0 + 75_000), 0),
                (removals, b"0", _removal(0, 1 << 40, 5, M0 + 3 * MINUTE), 0)]
    produce(site_a.bootstrap, records)

    output = tmp_path / "health"
    assert sluice_main(["pipeline", "queue-health", "-c", str(tmp_path / "site.yaml"), "--output", str(output),
                        "--since", "3h"]) == 0
    printed = capsys.readouterr().out
    assert f"{queue}: 1 records could not be decoded and were left out" in printed

    rows = {(r["partition"], r["minute"].timestamp() * 1000): r
            for r in spark.read.parquet(str(output / "queue_health")).collect()}
    m0, m1 = float(M0), float(M0 + MINUTE)
    assert set(rows) == {(0, m0), (0, m1), (1, m1)}
    got = {key: (r["enqueued"], r["removed"], r["backlog"], r["pending"], r["wait_p50_ms"], r["wait_max_ms"])
           for key, r in rows.items()}
    waits = sorted(_waits(enqueued_0))
    assert waits == [63_000, 64_000, 65_000, 70_000, 71_000, 72_000]
    assert got == {
        # p50 of six: the smallest wait with at least half at or below it, the third.
        (0, m0): (6, 0, 6, 0, waits[2], waits[5]),
        (0, m1): (0, 6, 0, 0, None, None),
        (1, m1): (3, 0, 3, 3, None, None),
    }
    chart = output / "queue_health.png"
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 10_000


def _waits(enqueued: list[int]) -> list[int]:
    """Each event's wait: offsets 0..2 removed at M0+65 s, 3..5 at M0+75 s."""
    return [(M0 + 65_000 if i < 3 else M0 + 75_000) - at for i, at in enumerate(enqueued)]


def test_since_takes_durations_and_iso_times_and_names_a_bad_one() -> None:
    """--since accepts 90s/30m/2h/1d back from now and ISO times (UTC without a zone); anything else is
    refused with the accepted forms."""
    now = dt.datetime(2026, 11, 22, 12, 0, tzinfo=dt.timezone.utc)
    assert parse_since("2h", now) == int(now.timestamp() * 1000) - 7_200_000
    assert parse_since("90s", now) == int(now.timestamp() * 1000) - 90_000
    assert parse_since("2026-11-22T10:00:00Z", now) == parse_since("2026-11-22T10:00:00", now) \
        == int(dt.datetime(2026, 11, 22, 10, tzinfo=dt.timezone.utc).timestamp() * 1000)
    from sluice.core.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match=r"--since: must be a duration \(90s, 30m, 2h, 1d\)"):
        parse_since("yesterday", now)
