"""The event lake on a real broker and a local Spark: exactly the changelog's rows, through a kill -9 and a restart."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from sluice.cli import main as sluice_main
from sluice.core.events import EntryEvent, Operation

from pipelinekit import DRIVER_JAVA_OPTIONS, Produced, encode, entry_event, produce, write_site

#: Two Spark JVMs (the killed job's and the tests' session) on 2 cores: ~35 s on a quiet machine, several
#: times that when other work shares it.
pytestmark = pytest.mark.timeout(480)

REPO = Path(__file__).resolve().parents[2]
BUCKETS = 4
#: Small micro-batches (4 for the first 160 events), so that the killed run dies between its first and its last.
PER_TRIGGER = 45


def _events(first: int, count: int) -> list[EntryEvent]:
    """Updates of 40 keys, with a destroy and an invalidate now and then; event times a minute apart
    across two days, so the lake has two date partitions."""
    out = []
    day_before = 1_700_000_000_000 - 86_400_000
    for seq in range(first, first + count):
        key = f"order-{seq % 40:03d}"
        op = Operation.DESTROY if seq % 17 == 5 else Operation.INVALIDATE if seq % 23 == 7 else Operation.UPDATE
        out.append(entry_event("orders", key, seq, buckets=BUCKETS, op=op, value=f'{{"seq": {seq}}}'.encode(),
                               timestamp=day_before + seq * 60_000, entry_version=seq // 40 + 1))
    return out


def _produce_events(cfg: Any, bootstrap: str, events: list[EntryEvent]) -> dict[tuple[int, int], EntryEvent]:
    topic = cfg.topics.region_changelog("orders")
    positions = produce(bootstrap, [(topic, e.key.encode(), encode("EntryEvent", e.to_record()), e.bucket)
                                    for e in events])
    return {(p.partition, p.offset): e for p, e in zip(positions, events)}


def _lake_args(site: Path, lake: Path) -> list[str]:
    return ["pipeline", "lake", "-c", str(site), "--lake", str(lake), "--available-now",
            "--max-offsets-per-trigger", str(PER_TRIGGER), "--master", "local[2]", "--conf", "spark.ui.enabled=false",
            "--conf", f"spark.driver.extraJavaOptions={DRIVER_JAVA_OPTIONS}"]


def _run_and_kill(args: list[str], after_batch: int, log: Path, timeout_s: float = 240) -> list[str]:
    """Run ``sluice`` ARGS in a process group of its own; kill -9 the group (the Python driver and
    Spark's JVM) as soon as it reports events batch ``after_batch``.  Returns its progress lines."""
    proc = subprocess.Popen([sys.executable, "-m", "sluice.cli", *args], cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stderr], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            line = proc.stderr.readline().decode(errors="replace")
            if not line:
                break
            lines.append(line.rstrip())
            if f"lake: events batch {after_batch}:" in line:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
                return lines
        log.write_text("\n".join(lines))
        raise AssertionError(f"the lake never reported events batch {after_batch} (exit {proc.poll()}); "
                             f"its output is in {log}:\n" + "\n".join(lines[-30:]))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        proc.stderr.close()


def _check_rows(spark: Any, lake: Path, expected: dict[tuple[int, int], EntryEvent], corrupt: list[Produced]) -> None:
    """The lake's events dataset holds one row per changelog record: the expected events, field by field,
    and the corrupt records with their reasons, nothing else."""
    rows = spark.read.parquet(str(lake / "events")).collect()
    positions = [(r["partition"], r["offset"]) for r in rows]
    assert len(positions) == len(set(positions)), "a changelog record is in the lake twice"
    decoded = {(r["partition"], r["offset"]): r for r in rows if r["corrupt"] is None}
    assert set(decoded) == set(expected), (
        f"missing {sorted(set(expected) - set(decoded))[:5]}, unexpected {sorted(set(decoded) - set(expected))[:5]}")
    for position, event in expected.items():
        row = decoded[position]
        assert (row["region"], row["key"], row["operation"], row["value"], row["bucket"]) == (
            event.region, event.key, event.operation.value, event.value, event.bucket)
        assert (row["event_id"]["member_id"], row["event_id"]["sequence_id"]) == (
            event.event_id.member_id, event.event_id.sequence_id)
        assert (row["version"]["dsid"], row["version"]["entry_version"], row["origin_dsid"]) == (
            event.version.dsid, event.version.entry_version, event.origin_dsid)
        assert int(row["event_time"].timestamp() * 1000) == event.event_time
        assert row["date"].isoformat() == time.strftime("%Y-%m-%d", time.gmtime(event.event_time / 1000))
        assert row["raw"] is None
    bad = sorted((r["partition"], r["offset"], r["corrupt"], r["region"]) for r in rows if r["corrupt"] is not None)
    assert bad == sorted([(corrupt[0].partition, corrupt[0].offset, "missing single-object marker C3 01 "
                           "(starts with 6e6f)", "orders"),
                          (corrupt[1].partition, corrupt[1].offset, "expected a EntryEvent record, got a "
                           "RemovalRecord record", "orders")])


def test_lake_holds_exactly_the_changelog_through_a_kill_and_a_restart(spark: Any, site_a: Any, unique_prefix: str,
                                                                      tmp_path: Path) -> None:
    """A changelog of known events (and two corrupt records) lands in the lake one row each; a run killed
    with SIGKILL after its first micro-batch and started again leaves neither a gap nor a repeat; a later
    run adds only the new events; dead letters land in their own dataset."""
    site = tmp_path / "site.yaml"
    cfg = write_site(site, site="a", dsid=1, bootstrap=site_a.bootstrap, prefix=site_a.topic_prefix(unique_prefix),
                     regions={"orders": BUCKETS}, sender="to-b")
    changelog = cfg.topics.region_changelog("orders")
    expected = _produce_events(cfg, site_a.bootstrap, _events(0, 160))
    removal = encode("RemovalRecord", {"queue_id": "to-b", "queue_partition": 0, "batch_id": 1,
                                       "last_removed_offset": 0, "last_event_id": None, "removed_count": 1,
                                       "removed_at": 1_700_000_000_000})
    corrupt = produce(site_a.bootstrap, [(changelog, b"order-001", b"not an avro record", 1),
                                         (changelog, b"order-002", removal, 2)])
    failed = next(iter(expected.values()))
    letters = [{"source_topic": changelog, "source_partition": 0, "source_offset": n, "key": b"k", "value": b"v",
                "reason": f"listener refused it ({n})", "error_class": "ValueError",
                "event": failed.to_record() if n else None, "service": "dispatcher", "failed_at": 1_700_000_000_000}
               for n in range(3)]
    produce(site_a.bootstrap, [(cfg.topics.dead_letter("to-b"), None, encode("DeadLetter", d), 0) for d in letters])

    lake = tmp_path / "lake"
    _run_and_kill(_lake_args(site, lake), after_batch=0, log=tmp_path / "killed-run.log")
    written = spark.read.parquet(str(lake / "events")).count()
    assert 0 < written < len(expected) + len(corrupt), f"the run was not killed mid-way ({written} rows)"

    assert sluice_main(_lake_args(site, lake)) == 0
    _check_rows(spark, lake, expected, corrupt)

    expected.update(_produce_events(cfg, site_a.bootstrap, _events(160, 40)))
    assert sluice_main(_lake_args(site, lake)) == 0
    _check_rows(spark, lake, expected, corrupt)

    dead = spark.read.parquet(str(lake / "dead_letters")).orderBy("source_offset").collect()
    assert [(d["queue"], d["reason"], d["corrupt"]) for d in dead] == [
        ("to-b", f"listener refused it ({n})", None) for n in range(3)]
    assert [d["region"] for d in dead] == ["orders"] * 3  # from the changelog the letter names, or its event
    assert dead[1]["event"]["key"] == failed.key and dead[0]["event"] is None


def test_lake_refuses_an_unknown_region_and_a_missing_topic(site_a: Any, unique_prefix: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Bad input is answered before Spark starts, with exit status 2 and the name of what is wrong."""
    site = tmp_path / "site.yaml"
    write_site(site, site="a", dsid=1, bootstrap=site_a.bootstrap, prefix=site_a.topic_prefix(unique_prefix),
               regions={"orders": 2})
    assert sluice_main(["pipeline", "lake", "-c", str(site), "--lake", str(tmp_path / "lake"),
                        "--region", "ordres"]) == 2
    assert "--region: no such region in site a's file (it has orders) (got 'ordres')" in capsys.readouterr().err

    other = tmp_path / "other.yaml"
    other.write_text(site.read_text().replace(site_a.topic_prefix(unique_prefix), f"{unique_prefix}none."))
    assert sluice_main(["pipeline", "lake", "-c", str(other), "--lake", str(tmp_path / "lake")]) == 2
    err = capsys.readouterr().err
    assert f"topic '{unique_prefix}none.region.orders.changelog' does not exist" in err
    assert "sluice topics apply" in err
