"""Cross-site reconciliation on two real brokers and a local Spark: it names exactly the injected divergences."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from sluice.cli import main as sluice_main
from sluice.core.events import EntryEvent, Operation, VersionTag
from sluice.region.conflicts import remote_wins

from pipelinekit import encode, entry_event, produce, write_site

pytestmark = pytest.mark.timeout(240)

T0 = 1_700_000_000_000
REGIONS = {"orders": 4, "customers": 2}


def _write(bootstrap: str, cfg: Any, events: list[EntryEvent]) -> None:
    produce(bootstrap, [(cfg.topics.region_changelog(e.region), e.key.encode(), encode("EntryEvent", e.to_record()),
                         e.bucket) for e in events])


def _replicated(region: str, n: int) -> list[EntryEvent]:
    """Events both sites applied alike (as WAN replication leaves them: the origin's version tags)."""
    buckets = REGIONS[region]
    events = []
    for seq in range(n):
        key = f"{region}-{seq % 12:02d}"
        op = Operation.DESTROY if seq == 20 else Operation.INVALIDATE if seq == 21 else Operation.UPDATE
        dsid = 1 + seq % 2
        events.append(entry_event(region, key, seq, buckets=buckets, op=op, value=f'{{"n": {seq}}}'.encode(),
                                  dsid=dsid, timestamp=T0 + seq, entry_version=seq // 12 + 1, member=f"site{dsid}"))
    return events


def test_reconciliation_names_exactly_the_three_injected_divergences(
        spark: Any, site_a: Any, site_b: Any, unique_prefix: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Two sites agree on 24 keys of orders and all of customers, except for a key only a has, a key both
    wrote concurrently with different values, and a key whose second (same-valued) write b missed: the
    report holds exactly those three, each with the winner Geode's rule picks, and the exit status is 1."""
    cfg_a = write_site(tmp_path / "a.yaml", site="a", dsid=1, bootstrap=site_a.bootstrap,
                       prefix=site_a.topic_prefix(unique_prefix), regions=REGIONS)
    cfg_b = write_site(tmp_path / "b.yaml", site="b", dsid=2, bootstrap=site_b.bootstrap,
                       prefix=site_b.topic_prefix(unique_prefix), regions=REGIONS)
    common = _replicated("orders", 30) + _replicated("customers", 24)
    buckets = REGIONS["orders"]
    # 1. Missing key: a's write never reached b.
    missing = entry_event("orders", "missing-key", 100, buckets=buckets, value=b'{"a": 1}', timestamp=T0 + 100)
    # 2. Different value: each site wrote the key; b's write is later, so b's should win everywhere.
    mine = entry_event("orders", "conflict-key", 101, buckets=buckets, value=b'{"by": "a"}', timestamp=T0 + 200)
    theirs = entry_event("orders", "conflict-key", 7, buckets=buckets, value=b'{"by": "b"}', dsid=2,
                         timestamp=T0 + 300, member="site2")
    # 3. Stale version: a put the same value twice; b has only the first (entry version 1 of 2).
    first = entry_event("orders", "stale-key", 102, buckets=buckets, value=b'{"same": true}', timestamp=T0 + 400)
    second = entry_event("orders", "stale-key", 103, buckets=buckets, value=b'{"same": true}', timestamp=T0 + 500,
                         entry_version=2)
    _write(site_a.bootstrap, cfg_a, [*common, missing, mine, first, second])
    _write(site_b.bootstrap, cfg_b, [*common, theirs, first])

    output = tmp_path / "report"
    args = ["pipeline", "reconcile", "--site-a", str(tmp_path / "a.yaml"), "--site-b", str(tmp_path / "b.yaml"),
            "--output", str(output)]
    assert sluice_main(args) == 1
    printed = capsys.readouterr().out
    assert "DIVERGED: 3 keys in 1 of 2 regions" in printed
    assert "'conflict-key': b wins (the later timestamp)" in printed

    report = {r["key"]: r for r in spark.read.parquet(str(output)).collect()}
    assert {k: (r["region"], r["kind"], r["winner"], r["winner_site"], r["rule"]) for k, r in report.items()} == {
        "missing-key": ("orders", "only_in_a", "a", "a", "only one site has a record of the key"),
        "conflict-key": ("orders", "value_differs", "b", "b", "the later timestamp"),
        "stale-key": ("orders", "version_differs", "a", "a", "same site wrote both: the higher entry version"),
    }
    assert report["conflict-key"]["a_value"] == b'{"by": "a"}' and report["conflict-key"]["b_value"] == b'{"by": "b"}'
    assert (report["stale-key"]["a_version"]["entry_version"], report["stale-key"]["b_version"]["entry_version"]) \
        == (2, 1)
    assert report["missing-key"]["b_version"] is None and not report["missing-key"]["b_present"]

    # The agreeing region alone: exit status 0.  Of its 12 keys one is destroyed on both sites (absent, not
    # counted) and one invalidated on both (present without a value: agrees).
    assert sluice_main([*args[:-2], "--region", "customers"]) == 0
    assert "OK: the sites agree on 11 keys in 1 region" in capsys.readouterr().out


def test_reconciliation_refuses_a_region_one_site_lacks(site_a: Any, site_b: Any, unique_prefix: str,
                                                       tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A --region that one site file does not declare is bad input (exit 2), named, before Spark starts."""
    write_site(tmp_path / "a.yaml", site="a", dsid=1, bootstrap=site_a.bootstrap,
               prefix=site_a.topic_prefix(unique_prefix), regions={"orders": 2, "extra": 2})
    write_site(tmp_path / "b.yaml", site="b", dsid=2, bootstrap=site_b.bootstrap,
               prefix=site_b.topic_prefix(unique_prefix), regions={"orders": 2})
    code = sluice_main(["pipeline", "reconcile", "--site-a", str(tmp_path / "a.yaml"), "--site-b",
                        str(tmp_path / "b.yaml"), "--region", "extra"])
    assert code == 2
    assert "--region: no such region in site b's file (it has orders) (got 'extra')" in capsys.readouterr().err


def test_winner_rule_in_spark_is_geodes_remote_wins(spark: Any) -> None:
    """The SQL rule picks, for random pairs of version tags (same and different dsids, equal timestamps and
    versions included), exactly what ``remote_wins`` decides from each side."""
    from pyspark.sql import functions as F
    from sluice.pipelines.reconcile import winner_side

    rng = random.Random(9)
    pairs = [(VersionTag(rng.randint(1, 3), T0 + rng.randint(0, 3), rng.randint(1, 3)),
              VersionTag(rng.randint(1, 3), T0 + rng.randint(0, 3), rng.randint(1, 3))) for _ in range(400)]
    schema = "a struct<dsid:int, timestamp:timestamp, entry_version:long>, " \
             "b struct<dsid:int, timestamp:timestamp, entry_version:long>, n int"
    rows = [((a.dsid, _ts(a.timestamp), a.entry_version), (b.dsid, _ts(b.timestamp), b.entry_version), n)
            for n, (a, b) in enumerate(pairs)]
    frame = spark.createDataFrame(rows, schema)
    side, _ = winner_side(F.col("a"), F.col("b"))
    got = {r["n"]: r["side"] for r in frame.select("n", side.alias("side")).collect()}
    for n, (a, b) in enumerate(pairs):
        expected = "b" if remote_wins(a, b) else "a" if remote_wins(b, a) else None
        assert got[n] == expected, (a, b)
    assert {None, "a", "b"} <= set(got.values())


def _ts(ms: int) -> Any:
    import datetime as dt

    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc)
