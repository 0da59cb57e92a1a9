"""The SQL write-behind listener on SQLite (issue 4): no network, no sleeps.

What the listener promises, each proved below: a table that follows the
region (upsert, tombstone on destroy, NULL value on invalidate), one
transaction per batch, and idempotence under redelivery, including an older
batch replayed after newer ones and a destroy that a replayed create must
not undo.  PostgreSQL runs the same promises in
tests/integration/test_sql_listener_pg.py.  And dead letters (issue 17): an
event that can never be written leaves its batch, with the reason, when the
host keeps dead letters, and refuses it when the host does not.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sluice.core.asyncevent import Accepted, AsyncEvent, DeadLetter, load_listener_class
from sluice.core.errors import ClosedError, ConfigError
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.listeners.sql import SqlWriteBehindListener, is_newer, live_view_name, parse_settings

Op = Operation


def event(
    key: str,
    op: Operation,
    value: Any = None,
    version: int = 1,
    *,
    dsid: int = 1,
    timestamp: int | None = None,
    region: str = "orders",
    duplicate: bool = False,
    raw: bytes | None = None,
    encoding: str = "json",
) -> AsyncEvent:
    """One AsyncEvent; the timestamp defaults to grow with the entry version."""
    data = raw if raw is not None else (None if value is None else json.dumps(value).encode())
    entry = EntryEvent(
        region, key, op, data, EventID("member-1", 1, version), VersionTag(dsid, timestamp or 1_000 + version, version),
        dsid, 0, timestamp or 1_000 + version, value_encoding=encoding,
    )
    return AsyncEvent(entry, "q", 0, version, duplicate)


def replayed(events: list[AsyncEvent]) -> list[AsyncEvent]:
    """The same events as a redelivery after a failover shows them."""
    return [AsyncEvent(e.event, e.queue_id, e.partition, e.offset, True) for e in events]


DLQ = "sluice.queue.q.dlq"


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "writebehind.db"


@pytest.fixture
def listener(db: Path) -> Iterator[Callable[..., SqlWriteBehindListener]]:
    """``listener(**settings)``: an initialised listener on ``db``, closed at the end."""
    made: list[SqlWriteBehindListener] = []

    def make(*, dead_letter_topic: str | None = None, **settings: Any) -> SqlWriteBehindListener:
        settings.setdefault("url", f"sqlite:///{db}")
        settings.setdefault("table", "orders")
        instance = SqlWriteBehindListener()
        config = {"settings": settings, "queue_id": "q", "site": "a", "dsid": 1, "kafka": {}, "topic_prefix": ""}
        if dead_letter_topic is not None:
            config["dead_letter_topic"] = dead_letter_topic
        instance.init(config)
        made.append(instance)
        return instance

    yield make
    for instance in made:
        instance.close()


def table(db: Path, name: str = "orders") -> list[tuple[Any, ...]]:
    """Every row of the base table, tombstones included, in key order."""
    with sqlite3.connect(db) as conn:
        return conn.execute(f'SELECT * FROM "{name}" ORDER BY 1, 2').fetchall()


def live(db: Path, name: str = "orders") -> dict[str, Any]:
    """key -> parsed value, through the live view (no tombstones)."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute(f'SELECT "key", "value" FROM "{live_view_name(name)}"').fetchall()
    return {key: None if value is None else json.loads(value) for key, value in rows}


def stored(db: Path, key: str, name: str = "orders") -> dict[str, Any]:
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        row = conn.execute(f'SELECT * FROM "{name}" WHERE "key" = ?', (key,)).fetchone()
    return dict(row) if row is not None else {}


# --- the table follows the region -------------------------------------------------


def test_create_update_destroy_follow_the_region(listener: Callable[..., SqlWriteBehindListener], db: Path) -> None:
    """Creates and updates upsert the value; a destroy leaves a tombstone the live view hides."""
    sql = listener()
    assert sql.process_events([event("a", Op.CREATE, {"n": 1}, 1), event("b", Op.CREATE, {"n": 2}, 1)])
    assert sql.process_events([event("a", Op.UPDATE, {"n": 10}, 2), event("b", Op.DESTROY, None, 2)])
    assert live(db) == {"a": {"n": 10}}
    tombstone = stored(db, "b")
    assert tombstone["value"] is None and tombstone["sluice_deleted"] == 1
    assert (tombstone["sluice_entry_version"], tombstone["sluice_operation"]) == (2, "DESTROY")
    assert stored(db, "a")["sluice_entry_version"] == 2


@pytest.mark.parametrize("op", [Op.CREATE, Op.UPDATE, Op.PUTALL_CREATE, Op.PUTALL_UPDATE])
def test_every_put_kind_upserts(listener: Callable[..., SqlWriteBehindListener], db: Path, op: Operation) -> None:
    """Every create and update kind, putAll's included, writes the value."""
    assert listener().process_events([event("k", op, {"v": op.value}, 1)])
    assert live(db) == {"k": {"v": op.value}}


@pytest.mark.parametrize("op", [Op.DESTROY, Op.REMOVEALL_DESTROY, Op.EXPIRE_DESTROY])
def test_every_destroy_kind_leaves_a_tombstone(listener: Callable[..., SqlWriteBehindListener], db: Path,
                                                op: Operation) -> None:
    """Every destroy kind an async event queue carries, removeAll's and expiration's included, removes the key."""
    sql = listener()
    assert sql.process_events([event("k", Op.CREATE, {"v": 1}, 1)])
    assert sql.process_events([event("k", op, None, 2)])
    assert live(db) == {}
    assert stored(db, "k")["sluice_operation"] == op.value


def test_invalidate_keeps_the_key_with_a_null_value(listener: Callable[..., SqlWriteBehindListener], db: Path) -> None:
    """An invalidate (never queued by the region service, handled to be safe) keeps the key with no value."""
    sql = listener(columns={"n": {"path": "n", "type": "integer"}})
    assert sql.process_events([event("k", Op.CREATE, {"n": 1}, 1)])
    assert sql.process_events([event("k", Op.INVALIDATE, None, 2)])
    assert live(db) == {"k": None}
    assert stored(db, "k")["n"] is None


@pytest.mark.parametrize("op", [Op.LOCAL_DESTROY, Op.REGION_CLEAR, Op.REGION_DESTROY, Op.UNKNOWN])
def test_operations_no_queue_carries_are_ignored(listener: Callable[..., SqlWriteBehindListener], db: Path,
                                                 op: Operation) -> None:
    """Local and region operations never leave a member in Geode: accepted, counted, not written."""
    sql = listener()
    assert sql.process_events([event("k", Op.CREATE, {"v": 1}, 1)])
    assert sql.process_events([event("k", op, None, 2)])
    assert live(db) == {"k": {"v": 1}}
    assert sql.stats.events_ignored == 1


def test_an_empty_batch_is_accepted(listener: Callable[..., SqlWriteBehindListener], db: Path) -> None:
    """An empty batch is accepted without touching the database."""
    assert listener().process_events([])
    assert table(db) == []


# --- idempotence ------------------------------------------------------------------------


def test_a_replayed_batch_changes_nothing(listener: Callable[..., SqlWriteBehindListener], db: Path) -> None:
    """Offering an applied batch again (possibleDuplicate) leaves every row, versions included, as it was."""
    sql = listener(columns={"n": {"path": "n", "type": "integer"}})
    batch = [event("a", Op.CREATE, {"n": 1}, 1), event("b", Op.CREATE, {"n": 2}, 1),
             event("a", Op.UPDATE, {"n": 3}, 2), event("c", Op.CREATE, {"n": 4}, 1), event("c", Op.DESTROY, None, 2)]
    assert sql.process_events(batch)
    before = table(db)
    assert sql.process_events(replayed(batch))
    assert table(db) == before
    assert (sql.stats.rows_written, sql.stats.rows_stale) == (3, 3)


def test_an_older_batch_replayed_after_newer_ones_changes_nothing(listener: Callable[..., SqlWriteBehindListener],
                                                                  db: Path) -> None:
    """After a failover an old batch may come back behind newer ones: stored newer versions win."""
    sql = listener()
    first = [event("a", Op.CREATE, {"n": 1}, 1), event("b", Op.CREATE, {"n": 1}, 1)]
    second = [event("a", Op.UPDATE, {"n": 2}, 2), event("b", Op.UPDATE, {"n": 2}, 2)]
    third = [event("a", Op.UPDATE, {"n": 3}, 3)]
    for batch in (first, second, third):
        assert sql.process_events(batch)
    before = table(db)
    assert sql.process_events(replayed(first))
    assert sql.process_events(replayed(second))
    assert table(db) == before
    assert live(db) == {"a": {"n": 3}, "b": {"n": 2}}


def test_a_destroy_is_not_undone_by_a_replayed_older_create(listener: Callable[..., SqlWriteBehindListener],
                                                            db: Path) -> None:
    """The tombstone keeps the destroy's version, so replayed older creates and updates do not resurrect the key."""
    sql = listener()
    create, update = event("k", Op.CREATE, {"n": 1}, 1), event("k", Op.UPDATE, {"n": 2}, 2)
    assert sql.process_events([create, update])
    assert sql.process_events([event("k", Op.DESTROY, None, 3)])
    assert sql.process_events(replayed([create]))
    assert sql.process_events(replayed([update]))
    assert live(db) == {}
    # The entry version goes on across the destroy (region/state.py): a new create is newer.
    assert sql.process_events([event("k", Op.CREATE, {"n": "again"}, 4)])
    assert live(db) == {"k": {"n": "again"}}


def test_a_destroy_of_a_key_never_written_still_leaves_a_tombstone(listener: Callable[..., SqlWriteBehindListener],
                                                                   db: Path) -> None:
    """A destroy arriving before its create (replay order) still blocks that older create."""
    sql = listener()
    assert sql.process_events([event("k", Op.DESTROY, None, 2)])
    assert sql.process_events([event("k", Op.CREATE, {"n": 1}, 1, duplicate=True)])
    assert live(db) == {}


def test_events_of_one_key_collapse_to_the_newest(listener: Callable[..., SqlWriteBehindListener], db: Path) -> None:
    """Within a batch a key becomes one row: the newest event's, even when an older one comes later."""
    sql = listener()
    batch = [event("a", Op.CREATE, {"n": 1}, 1), event("a", Op.UPDATE, {"n": 2}, 2), event("a", Op.UPDATE, {"n": 3}, 3),
             event("a", Op.UPDATE, {"n": 2}, 2, duplicate=True), event("b", Op.CREATE, {"n": 1}, 1),
             event("b", Op.DESTROY, None, 2)]
    assert sql.process_events(batch)
    assert live(db) == {"a": {"n": 3}}
    assert sql.stats.rows_written == 2


@pytest.mark.parametrize(
    ("stored_tag", "incoming_tag", "newer"),
    [
        ((1, 100, 5), (1, 100, 5), False),  # the same version: a replay
        ((1, 100, 5), (1, 100, 6), True),   # same dsid and timestamp: the newer entry version
        ((1, 100, 5), (1, 100, 4), False),
        ((1, 100, 67), (1, 200, 63), True),  # a later write of the same site, after the other site's
        ((1, 100, 5), (1, 200, 5), True),    # events reset the entry version to their own count
        ((1, 200, 63), (1, 100, 67), False),
        ((1, 100, 5), (2, 150, 1), True),   # other dsid: the later timestamp wins
        ((1, 100, 5), (2, 50, 9), False),
        ((1, 100, 5), (2, 100, 1), True),   # equal timestamps: the higher dsid wins
        ((2, 100, 5), (1, 100, 9), False),
    ],
)
def test_the_version_rule(listener: Callable[..., SqlWriteBehindListener], db: Path, stored_tag: tuple[int, int, int],
                          incoming_tag: tuple[int, int, int], newer: bool) -> None:
    """The database applies exactly what ``is_newer`` calls newer: (timestamp, dsid, entry version) order."""
    assert is_newer(VersionTag(*incoming_tag), VersionTag(*stored_tag)) is newer
    sql = listener()
    (d1, t1, v1), (d2, t2, v2) = stored_tag, incoming_tag
    assert sql.process_events([event("k", Op.CREATE, "stored", v1, dsid=d1, timestamp=t1)])
    assert sql.process_events([event("k", Op.UPDATE, "incoming", v2, dsid=d2, timestamp=t2)])
    assert live(db) == {"k": "incoming" if newer else "stored"}


def test_a_write_after_the_other_sites_events_replaces_the_row_whatever_the_batches(
        listener: Callable[..., SqlWriteBehindListener], db: Path) -> None:
    """A key's history at site 1, as its queue delivers it: site 1 writes entry versions 65 to 67, site 2's later
    writes (entry versions 61 and 62, counted on from what site 2 had) win there, then site 1 writes again and
    counts on from them: 63.  However the dispatcher cuts that into batches, and after any replay, the row ends at
    the last write."""
    history = [event("k", Op.UPDATE, {"n": n}, v, dsid=d, timestamp=t)
               for n, (d, t, v) in enumerate([(1, 100, 65), (1, 110, 66), (1, 120, 67), (2, 130, 61), (2, 140, 62),
                                              (1, 150, 63)])]
    for cut in range(1, len(history)):
        sql = listener(table=f"orders_{cut}")
        assert sql.process_events(history[:cut])
        assert sql.process_events(history[cut:])
        assert sql.process_events(replayed(history[:cut]))
        assert live(db, f"orders_{cut}") == {"k": {"n": 5}}, cut


# --- layout -------------------------------------------------------------------------------


def test_columns_map_value_fields_to_typed_columns(listener: Callable[..., SqlWriteBehindListener], db: Path) -> None:
    """Dotted paths fill their own columns, list indexes included; what is missing is NULL."""
    sql = listener(columns={
        "customer": "customer.id",
        "first_sku": "items.0.sku",
        "qty": {"path": "qty", "type": "integer"},
        "total": {"path": "totals.sum", "type": "float"},
        "paid": {"path": "paid", "type": "boolean"},
        "address": {"path": "customer.address", "type": "json"},
        "note": "note",
    })
    value = {"customer": {"id": 42, "address": {"city": "Oslo"}}, "items": [{"sku": "A-1"}], "qty": "7",
             "totals": {"sum": 9.5}, "paid": True}
    assert sql.process_events([event("o1", Op.CREATE, value, 1), event("o2", Op.CREATE, "just a string", 1),
                               event("o3", Op.CREATE, {"customer": None, "items": "not a list"}, 1)])
    o1, o2, o3 = stored(db, "o1"), stored(db, "o2"), stored(db, "o3")
    got = (o1["customer"], o1["first_sku"], o1["qty"], o1["total"], o1["paid"], o1["note"])
    assert got == ("42", "A-1", 7, 9.5, 1, None)
    assert json.loads(o1["address"]) == {"city": "Oslo"}
    mapped = ("customer", "first_sku", "qty", "total", "paid", "address", "note")
    assert all(o2[c] is None for c in mapped) and all(o3[c] is None for c in mapped)
    assert sql.process_events([event("o1", Op.DESTROY, None, 2)])
    assert all(stored(db, "o1")[c] is None for c in mapped)


def test_region_column_keeps_equal_keys_of_two_regions_apart(listener: Callable[..., SqlWriteBehindListener],
                                                             db: Path) -> None:
    """With region_column the key is unique per region, and versions are compared per (region, key)."""
    sql = listener(region_column="region")
    assert sql.process_events([event("k", Op.CREATE, "in orders", 5, region="orders"),
                               event("k", Op.CREATE, "in customers", 1, region="customers")])
    assert sql.process_events([event("k", Op.DESTROY, None, 2, region="customers")])
    with sqlite3.connect(db) as conn:
        rows = conn.execute('SELECT "region", "key", "value" FROM "orders_live"').fetchall()
    assert rows == [("orders", "k", '"in orders"')]


def test_key_and_value_columns_are_named_by_the_settings(listener: Callable[..., SqlWriteBehindListener],
                                                         db: Path) -> None:
    """key_column and value_column name the table's columns."""
    sql = listener(table="people", key_column="id", value_column="doc")
    assert sql.process_events([event("p1", Op.CREATE, {"name": "Ada"}, 1)])
    with sqlite3.connect(db) as conn:
        assert conn.execute('SELECT "id", "doc" FROM "people_live"').fetchall() == [("p1", '{"name": "Ada"}')]


def test_an_existing_table_is_used_when_create_table_is_false(listener: Callable[..., SqlWriteBehindListener],
                                                              db: Path) -> None:
    """With create_table false the listener writes into a table someone else made."""
    with sqlite3.connect(db) as conn:
        conn.execute('CREATE TABLE mine ("key" TEXT PRIMARY KEY, "value" TEXT, "sluice_version_dsid" INTEGER, '
                     '"sluice_version_timestamp" INTEGER, "sluice_entry_version" INTEGER, "sluice_deleted" INTEGER, '
                     '"sluice_operation" TEXT, "extra" TEXT DEFAULT \'kept\')')
    sql = listener(table="mine", create_table=False)
    assert sql.process_events([event("k", Op.CREATE, [1, 2], 1)])
    assert table(db, "mine") == [("k", "[1, 2]", 1, 1001, 1, 0, "CREATE", "kept")]


def test_values_keep_their_json_text_and_big_integers(listener: Callable[..., SqlWriteBehindListener],
                                                      db: Path) -> None:
    """The value column holds the value's JSON as written, integers beyond 64 bits included."""
    sql = listener(columns={"big": {"path": "big", "type": "json"}})
    raw = b'{"big": 1180591620717411303424}'
    assert sql.process_events([event("k", Op.CREATE, raw=raw)])
    row = stored(db, "k")
    assert (row["value"], row["big"]) == (raw.decode(), "1180591620717411303424")


def test_the_database_is_in_wal_mode(listener: Callable[..., SqlWriteBehindListener], db: Path) -> None:
    """SQLite runs in WAL mode, so readers of the table never block the writer."""
    listener()
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_relative_sqlite_url_is_relative_to_the_working_directory(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """sqlite:///data/x.db names data/x.db under the working directory, creating data/."""
    monkeypatch.chdir(tmp_path)
    sql = SqlWriteBehindListener()
    sql.init({"settings": {"url": "sqlite:///data/x.db", "table": "orders"}})
    try:
        assert sql.process_events([event("k", Op.CREATE, 1, 1)])
    finally:
        sql.close()
    assert live(tmp_path / "data" / "x.db") == {"k": 1}


# --- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "field", "reason"),
    [
        ({"table": "t"}, "listener.settings.url", "is required"),
        ({"url": "mysql://h/db", "table": "t"}, "listener.settings.url", "sqlite or postgresql"),
        ({"url": "sqlite://host/x.db", "table": "t"}, "listener.settings.url", "no host"),
        ({"url": "sqlite:///:memory:", "table": "t"}, "listener.settings.url", "in-memory"),
        ({"url": "sqlite:///x.db"}, "listener.settings.table", "is required"),
        ({"url": "sqlite:///x.db", "table": "Orders"}, "listener.settings.table", "lowercase"),
        ({"url": "sqlite:///x.db", "table": "s.t"}, "listener.settings.table", "PostgreSQL only"),
        ({"url": "sqlite:///x.db", "table": "t", "tabel": "u"}, "listener.settings.tabel", "did you mean 'table'"),
        ({"url": "sqlite:///x.db", "table": "t", "key_column": "value"}, "listener.settings.value_column",
         "same column as key_column"),
        ({"url": "sqlite:///x.db", "table": "t", "region_column": "sluice_region"}, "listener.settings.region_column",
         "listener's own"),
        ({"url": "sqlite:///x.db", "table": "t", "columns": ["a"]}, "listener.settings.columns", "mapping"),
        ({"url": "sqlite:///x.db", "table": "t", "columns": {"n": {"path": "n", "type": "int"}}},
         "listener.settings.columns.n.type", "one of text, integer"),
        ({"url": "sqlite:///x.db", "table": "t", "columns": {"n": {"pth": "n"}}}, "listener.settings.columns.n.pth",
         "did you mean 'path'"),
        ({"url": "sqlite:///x.db", "table": "t", "columns": {"n": "a..b"}}, "listener.settings.columns.n",
         "dotted path"),
        ({"url": "sqlite:///x.db", "table": "t", "columns": {"key": "k"}}, "listener.settings.columns.key",
         "same column as key_column"),
        ({"url": "sqlite:///x.db", "table": "t", "create_table": "yes"}, "listener.settings.create_table",
         "true or false"),
        ({"url": "sqlite:///x.db", "table": "t", "timeout_s": 0}, "listener.settings.timeout_s", "> 0"),
    ],
)
def test_bad_settings_name_the_setting(settings: dict[str, Any], field: str, reason: str) -> None:
    """A wrong setting is a ConfigError naming the setting, the value and why."""
    with pytest.raises(ConfigError) as caught:
        SqlWriteBehindListener().init({"settings": settings})
    assert [p for p in caught.value.problems if p[0] == field and reason in p[2]], caught.value.problems


def test_every_settings_problem_is_listed_at_once() -> None:
    """One ConfigError lists every problem, and the password in a URL is not shown."""
    with pytest.raises(ConfigError) as caught:
        parse_settings({"url": "postgresql://u:secret@h:5432/db", "table": "Bad", "timeout": 3, "create_table": 1})
    fields = {p[0] for p in caught.value.problems}
    assert fields == {"listener.settings.table", "listener.settings.timeout", "listener.settings.create_table"}
    assert "secret" not in str(caught.value)


def test_a_table_without_the_needed_columns_is_a_config_error(db: Path) -> None:
    """An existing table lacking the listener's columns fails init, naming them, instead of every batch."""
    with sqlite3.connect(db) as conn:
        conn.execute('CREATE TABLE orders ("key" TEXT PRIMARY KEY, "value" TEXT)')
    with pytest.raises(ConfigError, match="lacks the columns sluice_version_dsid"):
        SqlWriteBehindListener().init({"settings": {"url": f"sqlite:///{db}", "table": "orders"}})


def test_a_missing_table_without_create_table_is_a_config_error(db: Path) -> None:
    """create_table false and no table: init says so."""
    with pytest.raises(ConfigError, match="does not exist and create_table is false"):
        settings = {"url": f"sqlite:///{db}", "table": "orders", "create_table": False}
        SqlWriteBehindListener().init({"settings": settings})


# --- failures: all or nothing, then the next offer ------------------------------------------


@pytest.mark.parametrize("dead_letter_topic", [None, DLQ])
def test_a_locked_database_returns_false_and_the_next_offer_succeeds(listener: Callable[..., SqlWriteBehindListener],
                                                                     db: Path, dead_letter_topic: str | None) -> None:
    """Another writer holding the lock past timeout_s fails the offer (False, no exception); the retry writes.
    A locked database is not the events' fault: with a dead-letter topic too, no event is a dead letter."""
    sql = listener(timeout_s=0.01, **({"dead_letter_topic": dead_letter_topic} if dead_letter_topic else {}))
    holder = sqlite3.connect(db, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        batch = [event("k", Op.CREATE, {"n": 1}, 1)]
        assert sql.process_events(batch) is False
        holder.execute("ROLLBACK")
        assert sql.process_events(batch) is True
    finally:
        holder.close()
    assert live(db) == {"k": {"n": 1}}
    assert (sql.stats.batches_failed, sql.stats.batches_written) == (1, 1)
    assert sql.stats.events_dead_lettered == 0


def test_a_connection_closed_underneath_is_replaced(listener: Callable[..., SqlWriteBehindListener], db: Path) -> None:
    """A connection that broke fails one offer; the next offer opens a new one and writes."""
    sql = listener()
    assert sql.process_events([event("a", Op.CREATE, 1, 1)])
    for conn in sql._idle:  # Reaching inside on purpose: nothing else closes it underneath.
        conn.close()
    batch = [event("b", Op.CREATE, 2, 1)]
    assert sql.process_events(batch) is False
    assert sql.process_events(batch) is True
    assert live(db) == {"a": 1, "b": 2}


def test_a_poison_row_rolls_back_the_whole_batch(listener: Callable[..., SqlWriteBehindListener], db: Path) -> None:
    """A value its column's type refuses fails the batch as a whole: rows before it are not written either."""
    sql = listener(columns={"qty": {"path": "qty", "type": "integer"}})
    assert sql.process_events([event("a", Op.CREATE, {"qty": 1}, 1)])
    before = table(db)
    batch = [event("a", Op.UPDATE, {"qty": 2}, 2), event("b", Op.CREATE, {"qty": 3}, 1),
             event("c", Op.CREATE, {"qty": "lots"}, 1)]
    assert sql.process_events(batch) is False
    assert table(db) == before
    batch[2] = event("c", Op.CREATE, {"qty": 4}, 1)
    assert sql.process_events(batch) is True
    assert {k: v["qty"] for k, v in live(db).items()} == {"a": 2, "b": 3, "c": 4}


def test_a_value_that_is_not_json_fails_the_batch_without_raising(listener: Callable[..., SqlWriteBehindListener],
                                                                  db: Path) -> None:
    """A value that cannot be decoded for the column mapping returns False; nothing of the batch is written."""
    sql = listener(columns={"n": "n"})
    assert sql.process_events([event("a", Op.CREATE, 1, 1), event("b", Op.CREATE, raw=b"{not json")]) is False
    assert table(db) == []


def test_an_unreachable_database_at_init_is_retried_on_each_offer(tmp_path: Path) -> None:
    """A database that cannot be opened at init is not fatal: offers fail until it can, then write."""
    blocker = tmp_path / "dir"
    blocker.write_text("a file where the directory should be")
    sql = SqlWriteBehindListener()
    sql.init({"settings": {"url": f"sqlite:///{blocker}/x.db", "table": "orders"}})
    try:
        batch = [event("k", Op.CREATE, 1, 1)]
        assert sql.process_events(batch) is False
        blocker.unlink()
        assert sql.process_events(batch) is True
    finally:
        sql.close()
    assert live(blocker / "x.db") == {"k": 1}


def test_non_json_values_are_kept_as_base64(listener: Callable[..., SqlWriteBehindListener], db: Path) -> None:
    """A value in another encoding than JSON is kept, base64 inside a JSON object, not refused."""
    sql = listener()
    assert sql.process_events([event("k", Op.CREATE, raw=b"\x00\xff", encoding="bytes")])
    assert live(db) == {"k": {"encoding": "bytes", "base64": "AP8="}}


def test_concurrent_dispatcher_threads_each_get_a_connection(listener: Callable[..., SqlWriteBehindListener],
                                                             db: Path) -> None:
    """Batches offered from several threads at once are all written (one connection per caller)."""
    sql = listener()
    start = threading.Barrier(4)
    results: list[bool] = []

    def offer(thread: int) -> None:
        start.wait()
        results.append(sql.process_events([event(f"t{thread}-{i}", Op.CREATE, i, 1) for i in range(50)]))

    threads = [threading.Thread(target=offer, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [True] * 4
    assert len(live(db)) == 200


# --- dead letters: events that can never be written (issue 17) ---------------------------------



def dead_letters(result: bool | Accepted) -> list[tuple[str, int, str]]:
    """(key, entry version, error class) of each dead letter an accepted result names."""
    assert isinstance(result, Accepted), result
    assert all(isinstance(letter, DeadLetter) and letter.reason for letter in result.dead_letters)
    return [(d.event.key, d.event.version.entry_version, d.error_class) for d in result.dead_letters]


def test_a_row_its_column_refuses_is_a_dead_letter_and_the_rest_is_written(
        listener: Callable[..., SqlWriteBehindListener], db: Path) -> None:
    """With a host that keeps dead letters, a value its STRICT column refuses leaves the batch with the database's
    reason, every other row of the batch is written, and the same batch offered again gives the same answer."""
    sql = listener(dead_letter_topic=DLQ, columns={"qty": {"path": "qty", "type": "integer"}})
    assert sql.process_events([event("a", Op.CREATE, {"qty": 1}, 1)]) is True
    batch = [event("a", Op.UPDATE, {"qty": 2}, 2), event("b", Op.CREATE, {"qty": 3}, 1),
             event("y", Op.CREATE, {"qty": "lots"}, 1), event("z", Op.CREATE, {"qty": 4}, 1)]
    result = sql.process_events(batch)
    assert dead_letters(result) == [("y", 1, "IntegrityError")]
    assert isinstance(result, Accepted) and "qty" in result.dead_letters[0].reason
    assert result.dead_letters[0].event is batch[2]
    assert {k: v["qty"] for k, v in live(db).items()} == {"a": 2, "b": 3, "z": 4}
    before = table(db)
    assert dead_letters(sql.process_events(replayed(batch))) == [("y", 1, "IntegrityError")]
    assert table(db) == before
    assert (sql.stats.events_dead_lettered, sql.stats.batches_failed) == (2, 0)


def test_undecodable_values_are_dead_letters(listener: Callable[..., SqlWriteBehindListener], db: Path) -> None:
    """A value that is not UTF-8, or not JSON where a column needs its fields, is a dead letter saying so."""
    sql = listener(dead_letter_topic=DLQ, columns={"n": "n"})
    result = sql.process_events([event("a", Op.CREATE, {"n": 1}, 1), event("b", Op.CREATE, raw=b"{not json"),
                                 event("c", Op.CREATE, raw=b"\xff\xfe"), event("d", Op.CREATE, {"n": 4}, 1)])
    assert dead_letters(result) == [("b", 1, "UndecodableValue"), ("c", 1, "UndecodableValue")]
    assert isinstance(result, Accepted)
    assert "not JSON" in result.dead_letters[0].reason and "not UTF-8" in result.dead_letters[1].reason
    assert live(db) == {"a": {"n": 1}, "d": {"n": 4}}


def test_a_number_beyond_64_bits_is_a_dead_letter_for_an_integer_column_only(
        listener: Callable[..., SqlWriteBehindListener], db: Path) -> None:
    """An integer no 64-bit column holds is a dead letter for an integer column; a float column takes it."""
    sql = listener(dead_letter_topic=DLQ, columns={"n": {"path": "n", "type": "integer"},
                                                   "f": {"path": "f", "type": "float"}})
    big = 2**70
    result = sql.process_events([event("a", Op.CREATE, raw=f'{{"n": {big}}}'.encode()),
                                 event("b", Op.CREATE, raw=f'{{"f": {big}}}'.encode())])
    assert dead_letters(result) == [("a", 1, "ValueDoesNotFit")]
    assert stored(db, "b")["f"] == float(big) and "a" not in live(db)


def test_a_constraint_the_events_data_violates_is_a_dead_letter(listener: Callable[..., SqlWriteBehindListener],
                                                                db: Path) -> None:
    """A CHECK constraint of a table made by hand, violated by one event's data, makes that event a dead letter."""
    with sqlite3.connect(db) as conn:
        conn.execute('CREATE TABLE mine ("key" TEXT PRIMARY KEY, "value" TEXT, "qty" INTEGER CHECK (qty >= 0), '
                     '"sluice_version_dsid" INTEGER, "sluice_version_timestamp" INTEGER, '
                     '"sluice_entry_version" INTEGER, "sluice_deleted" INTEGER, "sluice_operation" TEXT)')
    sql = listener(dead_letter_topic=DLQ, table="mine", create_table=False,
                   columns={"qty": {"path": "qty", "type": "integer"}})
    result = sql.process_events([event(f"k{i}", Op.CREATE, {"qty": -1 if i == 5 else i}, 1) for i in range(10)])
    assert dead_letters(result) == [("k5", 1, "IntegrityError")]
    assert isinstance(result, Accepted) and "CHECK constraint" in result.dead_letters[0].reason
    assert sorted(key for key, *_ in table(db, "mine")) == [f"k{i}" for i in range(10) if i != 5]


def test_a_key_whose_newest_event_is_refused_keeps_its_next_newest(
        listener: Callable[..., SqlWriteBehindListener], db: Path) -> None:
    """When a key's newest event of the batch can never be written, the key gets the newest one that can."""
    sql = listener(dead_letter_topic=DLQ, columns={"qty": {"path": "qty", "type": "integer"}})
    result = sql.process_events([event("k", Op.CREATE, {"qty": 1}, 1), event("k", Op.UPDATE, {"qty": 2}, 2),
                                 event("k", Op.UPDATE, {"qty": "three"}, 3), event("j", Op.CREATE, {"qty": 9}, 1)])
    assert dead_letters(result) == [("k", 3, "IntegrityError")]
    assert {k: v["qty"] for k, v in live(db).items()} == {"k": 2, "j": 9}
    assert stored(db, "k")["sluice_entry_version"] == 2


def test_without_a_dead_letter_topic_a_batch_with_a_refused_row_is_refused(
        listener: Callable[..., SqlWriteBehindListener], db: Path) -> None:
    """A host that keeps no dead letters (no dead_letter_topic) gets False and nothing written, never a drop."""
    sql = listener(columns={"qty": {"path": "qty", "type": "integer"}})
    batch = [event("a", Op.CREATE, {"qty": 1}, 1), event("b", Op.CREATE, {"qty": "lots"}, 1)]
    assert sql.process_events(batch) is False
    assert table(db) == [] and sql.stats.events_dead_lettered == 0


def test_every_event_of_a_batch_may_be_a_dead_letter(listener: Callable[..., SqlWriteBehindListener],
                                                     db: Path) -> None:
    """A batch whose every event can never be written is accepted with all of them as dead letters."""
    sql = listener(dead_letter_topic=DLQ, columns={"qty": {"path": "qty", "type": "integer"}})
    result = sql.process_events([event(f"k{i}", Op.CREATE, {"qty": f"x{i}"}, 1) for i in range(5)])
    assert [key for key, *_ in dead_letters(result)] == [f"k{i}" for i in range(5)]
    assert table(db) == []


# --- lifecycle -----------------------------------------------------------------------------------


def test_close_is_idempotent_and_a_closed_listener_refuses_batches(
    listener: Callable[..., SqlWriteBehindListener],
) -> None:
    """close() twice is fine; a batch after close is our bug and raises ClosedError."""
    sql = listener()
    sql.close()
    sql.close()
    with pytest.raises(ClosedError):
        sql.process_events([event("k", Op.CREATE, 1, 1)])


def test_listener_type_sql_loads_this_class() -> None:
    """A site file's ``listener.type: sql`` resolves to SqlWriteBehindListener."""
    assert load_listener_class("sql", None) is SqlWriteBehindListener
