"""The SQL write-behind listener on a real PostgreSQL server (issue 4).

The same promises as tests/unit/test_sql_listener.py (SQLite), on the
target that runs in production: typed columns, one transaction per batch
(a poison row leaves the table as it was), idempotence under redelivery,
reconnection after the server drops the connection, two dispatchers starting
together, and the write-behind rate for batches of 1000 (printed; run with
``-s`` to see it).  The ``postgres`` fixture comes from tests/pg.py.
"""

from __future__ import annotations

import gc
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sluice.core.asyncevent import AsyncEvent
from sluice.core.errors import ConfigError
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.listeners.sql import SqlWriteBehindListener, live_view_name

from pg import PostgresServer

Op = Operation
BATCH_SIZE = 1000
BATCHES = 50


def event(key: str, op: Operation, value: Any = None, version: int = 1, *, dsid: int = 1,
          timestamp: int | None = None, region: str = "orders", duplicate: bool = False) -> AsyncEvent:
    """One AsyncEvent; the timestamp defaults to grow with the entry version."""
    data = None if value is None else json.dumps(value).encode()
    ts = timestamp or 1_000 + version
    tag = VersionTag(dsid, ts, version)
    entry = EntryEvent(region, key, op, data, EventID("member-1", 1, version), tag, dsid, 0, ts)
    return AsyncEvent(entry, "q", 0, version, duplicate)


def replayed(events: list[AsyncEvent]) -> list[AsyncEvent]:
    return [AsyncEvent(e.event, e.queue_id, e.partition, e.offset, True) for e in events]


@pytest.fixture
def table_name(postgres: PostgresServer) -> str:
    return postgres.unique_name("wb")


@pytest.fixture
def listener(postgres: PostgresServer, table_name: str) -> Iterator[Callable[..., SqlWriteBehindListener]]:
    """``listener(**settings)``: an initialised listener on this test's table, closed at the end."""
    made: list[SqlWriteBehindListener] = []

    def make(queue_id: str = "q", **settings: Any) -> SqlWriteBehindListener:
        settings.setdefault("url", postgres.url)
        settings.setdefault("table", table_name)
        instance = SqlWriteBehindListener()
        instance.init({"settings": settings, "queue_id": queue_id, "site": "a", "dsid": 1, "kafka": {},
                       "topic_prefix": ""})
        made.append(instance)
        return instance

    yield make
    for instance in made:
        instance.close()


def snapshot(postgres: PostgresServer, table: str) -> list[tuple[Any, ...]]:
    """Every row of the base table, tombstones included, in key order."""
    with postgres.connect() as conn:
        return conn.execute(f'SELECT * FROM "{table}" ORDER BY 1, 2').fetchall()


def live(postgres: PostgresServer, table: str) -> dict[str, Any]:
    """key -> value through the live view (psycopg returns JSONB parsed)."""
    with postgres.connect() as conn:
        return dict(conn.execute(f'SELECT "key", "value" FROM "{live_view_name(table)}"').fetchall())


def test_the_table_follows_the_region_and_replays_change_nothing(
    postgres: PostgresServer, listener: Callable[..., SqlWriteBehindListener], table_name: str
) -> None:
    """Upsert, tombstone and invalidate on PostgreSQL; replays, of the last batch or an older one, change nothing."""
    sql = listener()
    first = [event("a", Op.CREATE, {"n": 1}, 1), event("b", Op.PUTALL_CREATE, {"n": 1}, 1),
             event("c", Op.CREATE, {"n": 1}, 1), event("d", Op.CREATE, {"n": 1}, 1)]
    second = [event("a", Op.UPDATE, {"n": 2}, 2), event("b", Op.REMOVEALL_DESTROY, None, 2),
              event("c", Op.INVALIDATE, None, 2), event("d", Op.EXPIRE_DESTROY, None, 2),
              event("e", Op.PUTALL_UPDATE, {"n": 2}, 2)]
    assert sql.process_events(first)
    assert sql.process_events(second)
    expected = {"a": {"n": 2}, "c": None, "e": {"n": 2}}
    assert live(postgres, table_name) == expected
    before = snapshot(postgres, table_name)
    assert sql.process_events(replayed(second))
    assert sql.process_events(replayed(first))
    assert snapshot(postgres, table_name) == before
    assert sql.stats.rows_stale == len(first) + len(second)
    with postgres.connect() as conn:
        tombstones = conn.execute(f'SELECT "key", sluice_entry_version, sluice_operation FROM "{table_name}" '
                                  "WHERE sluice_deleted ORDER BY 1").fetchall()
    assert tombstones == [("b", 2, "REMOVEALL_DESTROY"), ("d", 2, "EXPIRE_DESTROY")]


def test_a_destroy_is_not_undone_by_a_replayed_older_create(
    postgres: PostgresServer, listener: Callable[..., SqlWriteBehindListener], table_name: str
) -> None:
    """On PostgreSQL too, a tombstone stops replayed older writes; a newer create brings the key back."""
    sql = listener()
    create = event("k", Op.CREATE, {"n": 1}, 1)
    assert sql.process_events([create, event("k", Op.DESTROY, None, 2)])
    assert sql.process_events(replayed([create]))
    assert live(postgres, table_name) == {}
    assert sql.process_events([event("k", Op.CREATE, {"n": 3}, 3)])
    assert live(postgres, table_name) == {"k": {"n": 3}}


def test_the_version_rule_across_dsids(
    postgres: PostgresServer, listener: Callable[..., SqlWriteBehindListener], table_name: str
) -> None:
    """Another dsid's event wins by later timestamp, or by higher dsid on equal timestamps; not by entry version,
    which another site's events can set back."""
    sql = listener()
    assert sql.process_events([event("k", Op.CREATE, "site 1", 5, dsid=1, timestamp=100)])
    assert sql.process_events([event("k", Op.UPDATE, "site 2, earlier", 9, dsid=2, timestamp=99)])
    assert live(postgres, table_name) == {"k": "site 1"}
    assert sql.process_events([event("k", Op.UPDATE, "site 2, same time", 1, dsid=2, timestamp=100)])
    assert live(postgres, table_name) == {"k": "site 2, same time"}
    assert sql.process_events([event("k", Op.UPDATE, "site 1, same time", 6, dsid=1, timestamp=100)])
    assert live(postgres, table_name) == {"k": "site 2, same time"}
    # Site 1's later write counts on from site 2's entry version, below site 1's earlier one, and still replaces it.
    assert sql.process_events([event("j", Op.CREATE, "site 1, first", 67, dsid=1, timestamp=100)])
    assert sql.process_events([event("j", Op.UPDATE, "site 2", 61, dsid=2, timestamp=110),
                               event("j", Op.UPDATE, "site 1, later", 62, dsid=1, timestamp=120)])
    assert live(postgres, table_name) == {"k": "site 2, same time", "j": "site 1, later"}


def test_typed_columns_and_region_column_in_a_schema(
    postgres: PostgresServer, listener: Callable[..., SqlWriteBehindListener], table_name: str
) -> None:
    """Mapped columns get PostgreSQL types, the value is JSONB, and region_column keys rows per region."""
    schema = postgres.unique_name("s")
    with postgres.connect() as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    sql = listener(table=f"{schema}.{table_name}", region_column="region", columns={
        "customer": "customer.id",
        "qty": {"path": "qty", "type": "integer"},
        "total": {"path": "totals.sum", "type": "float"},
        "paid": {"path": "paid", "type": "boolean"},
        "address": {"path": "customer.address", "type": "json"},
    })
    value = {"customer": {"id": 42, "address": {"city": "Oslo"}}, "qty": 7, "totals": {"sum": 9.5}, "paid": True}
    assert sql.process_events([event("o1", Op.CREATE, value, 1, region="orders"),
                               event("o1", Op.CREATE, {"qty": "8"}, 1, region="archive")])
    with postgres.connect() as conn:
        types = dict(conn.execute(
            "SELECT column_name, data_type FROM information_schema.columns WHERE table_schema = %s AND table_name = %s",
            (schema, table_name)).fetchall())
        rows = conn.execute(f'SELECT region, key, value, customer, qty, total, paid, address '
                            f'FROM "{schema}"."{live_view_name(table_name)}" ORDER BY region').fetchall()
    assert (types["value"], types["qty"], types["total"], types["paid"], types["address"]) == (
        "jsonb", "bigint", "double precision", "boolean", "jsonb")
    assert rows == [("archive", "o1", {"qty": "8"}, None, 8, None, None, None),
                    ("orders", "o1", value, "42", 7, 9.5, True, {"city": "Oslo"})]


def test_a_poison_row_leaves_the_table_unchanged(
    postgres: PostgresServer, listener: Callable[..., SqlWriteBehindListener], table_name: str
) -> None:
    """One transaction per batch: a row its column type refuses fails the batch, and no row of it is written."""
    sql = listener(columns={"qty": {"path": "qty", "type": "integer"}})
    assert sql.process_events([event("a", Op.CREATE, {"qty": 1}, 1), event("z", Op.CREATE, {"qty": 1}, 1)])
    before = snapshot(postgres, table_name)
    batch = [event("a", Op.UPDATE, {"qty": 2}, 2), event("b", Op.CREATE, {"qty": 3}, 1),
             event("y", Op.CREATE, {"qty": "lots"}, 1), event("z", Op.DESTROY, None, 2)]
    assert sql.process_events(batch) is False
    assert sql.process_events(batch) is False  # offered again: still refused, still nothing written
    assert snapshot(postgres, table_name) == before
    batch[2] = event("y", Op.CREATE, {"qty": 4}, 1)
    assert sql.process_events(batch) is True
    assert {k: v["qty"] for k, v in live(postgres, table_name).items()} == {"a": 2, "b": 3, "y": 4}


def test_a_dropped_connection_fails_one_offer_and_the_next_reconnects(
    postgres: PostgresServer, listener: Callable[..., SqlWriteBehindListener], table_name: str
) -> None:
    """When the server terminates the listener's connection, the offer returns False and the next one writes."""
    queue_id = postgres.unique_name("q")
    sql = listener(queue_id=queue_id)
    assert sql.process_events([event("a", Op.CREATE, 1, 1)])
    with postgres.connect() as conn:
        killed = conn.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                              "WHERE application_name = %s", (f"sluice-sql-{queue_id}",)).fetchone()
    assert killed == (1,)
    batch = [event("b", Op.CREATE, 2, 1)]
    assert sql.process_events(batch) is False
    assert sql.process_events(batch) is True
    assert live(postgres, table_name) == {"a": 1, "b": 2}


def test_a_table_that_does_not_fit_the_settings_is_a_config_error(
    postgres: PostgresServer, table_name: str
) -> None:
    """An existing table without the listener's columns fails init with ConfigError naming them."""
    with postgres.connect() as conn:
        conn.execute(f'CREATE TABLE "{table_name}" ("key" text PRIMARY KEY, "value" jsonb)')
    with pytest.raises(ConfigError, match="lacks the columns sluice_version_dsid"):
        SqlWriteBehindListener().init({"settings": {"url": postgres.url, "table": table_name}})


def test_dispatchers_starting_together_both_prepare_the_table(
    postgres: PostgresServer, table_name: str
) -> None:
    """Several listeners creating the same table at once all start (the advisory lock serialises the DDL)."""
    start = threading.Barrier(4)
    errors: list[BaseException] = []
    made: list[SqlWriteBehindListener] = []

    def init() -> None:
        instance = SqlWriteBehindListener()
        start.wait()
        try:
            instance.init({"settings": {"url": postgres.url, "table": table_name}, "queue_id": "q"})
            made.append(instance)
        except BaseException as exc:  # Handed to the test thread below.
            errors.append(exc)

    threads = [threading.Thread(target=init) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert errors == []
        assert all(instance.process_events([event(f"k{i}", Op.CREATE, i, 1)]) for i, instance in enumerate(made))
    finally:
        for instance in made:
            instance.close()
    assert len(live(postgres, table_name)) == 4


def test_overlapping_batches_from_threads_end_at_the_newest_versions(
    postgres: PostgresServer, listener: Callable[..., SqlWriteBehindListener], table_name: str
) -> None:
    """Threads writing the same keys concurrently neither deadlock nor let an older version win."""
    sql = listener()
    keys = [f"k{i:03d}" for i in range(200)]
    start = threading.Barrier(4)
    results: list[bool] = []

    def offer(version: int) -> None:
        start.wait()
        batch = [event(k, Op.UPDATE, version, version) for k in (keys if version % 2 else reversed(keys))]
        results.append(sql.process_events(batch))

    threads = [threading.Thread(target=offer, args=(v,)) for v in (1, 2, 3, 4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [True] * 4
    assert set(live(postgres, table_name).values()) == {4}


def test_write_behind_rate_for_batches_of_1000(
    postgres: PostgresServer, listener: Callable[..., SqlWriteBehindListener], table_name: str
) -> None:
    """Batches of 1000 events are written at thousands of rows per second, and their replay too (figures printed)."""
    sql = listener(columns={"customer": "customer", "qty": {"path": "qty", "type": "integer"}})
    batches = [
        [event(f"order-{b:02d}-{i:04d}", Op.CREATE, {"customer": f"c{i % 97}", "qty": i, "note": "x" * 100}, 1)
         for i in range(BATCH_SIZE)]
        for b in range(BATCHES)
    ]

    def run(offered: list[list[AsyncEvent]]) -> tuple[float, list[float]]:
        latencies = []
        begin = time.perf_counter()
        for batch in offered:
            t0 = time.perf_counter()
            assert sql.process_events(batch)
            latencies.append(time.perf_counter() - t0)
        return BATCH_SIZE * len(offered) / (time.perf_counter() - begin), latencies

    # The events built ahead are moved out of the garbage collector's reach:
    # its full passes over 100,000 of them showed as 100+ ms batches that a
    # dispatcher, holding one batch at a time, would not see.
    replays = [replayed(batch) for batch in batches]
    gc.freeze()
    try:
        rate, latencies = run(batches)
        replay_rate, _ = run(replays)
    finally:
        gc.unfreeze()
    quantiles = statistics.quantiles(latencies, n=100)
    print(f"\nPostgreSQL write-behind ({postgres.describe}): {BATCHES} batches of {BATCH_SIZE}: "
          f"{rate:,.0f} rows/s, batch latency p50 {quantiles[49] * 1000:.1f} ms, p99 {quantiles[98] * 1000:.1f} ms; "
          f"replay of the same batches {replay_rate:,.0f} events/s")
    assert sql.stats.rows_written == BATCHES * BATCH_SIZE
    assert sql.stats.rows_stale == BATCHES * BATCH_SIZE
    assert rate > 2_000, f"write-behind at {rate:.0f} rows/s"
