"""SQL write-behind: an async event listener that keeps a table equal to a region (issue 4).

The story of one batch, step by step:

1. The dispatcher offers a batch.  Each event is classified: create and
   update (also ``PUTALL_*``) write the value; destroy (also
   ``REMOVEALL_DESTROY`` and ``EXPIRE_DESTROY``) writes a tombstone;
   invalidate (which Geode never delivers to async event queues, handled to be
   safe) keeps the key with a NULL value.  Local and region operations never
   leave a member in Geode and are ignored (counted in ``stats``).
2. The events of one key are collapsed to the newest by the version rule
   below, folding in queue order, so a key becomes one row of the batch.
3. One database transaction writes every row with one upsert statement whose
   conflict clause updates a stored row only when the incoming version is
   newer: PostgreSQL ``INSERT … SELECT FROM unnest(arrays) ON CONFLICT … DO
   UPDATE … WHERE``, SQLite ``executemany`` of ``INSERT … ON CONFLICT … DO
   UPDATE … WHERE`` inside ``BEGIN IMMEDIATE``.  Rows are sorted by key, so
   two dispatcher threads writing overlapping keys lock them in the same
   order and cannot deadlock.
4. The transaction ends: ``True`` and the queue removes the batch.  On a
   database error that may go away (the connection, a lock or statement
   timeout, a serialization failure, a deadlock) the transaction is rolled
   back (all or nothing) and ``process_events`` returns ``False``: the same
   batch is offered again.  A connection that broke is dropped and the next
   offer opens a new one.

Events that can never be written (issue 17).  Offering a batch again cannot
fix an event whose value is not UTF-8 or not JSON, or that the database
refuses for its own data: a value its column's type refuses (``"lots"`` for
an integer, a number out of range, a NUL character), a constraint it
violates (a CHECK or unique index of a table made by hand), a key too long
for the index.  Refusing the batch for it would wedge the queue, so when the
dispatcher can keep dead letters (``dead_letter_topic`` in the init config)
such events are left out and returned as ``Accepted(dead_letters)`` with the
reason, and the rest of the batch is written.  Which rows the database
refuses is found after the batch's statement fails with a data or integrity
error (PostgreSQL SQLSTATE classes 22 and 23, 54000; SQLite's integrity
errors): in a transaction that is rolled back afterwards, halves of the
batch are written under savepoints, down to the single rows that fail
alone.  Then the batch is built again without them (a key whose newest event
was left out gets its next newest of the batch, if any) and written in one
transaction as usual, so the rows of a batch still commit together.  Each
round leaves out at least one event, so this ends.  Without
``dead_letter_topic`` such a batch is refused, as any other failure.

Idempotence.  A replayed batch changes nothing because every row carries the
version of the event that wrote it, and an event is applied only when it is
newer.  That covers an *older* batch replayed after newer ones were applied
(a failover can do that), and destroys: a destroy leaves a tombstone row
(``sluice_deleted`` true, NULL value, the destroy's version) instead of
deleting the row, so a replayed older create or update cannot resurrect the
key.  Tombstones live in the same table rather than a table of their own so
that one statement, with one version check, covers every operation.
Readers see the live rows through the view ``<table>_live`` (created with
the table), or filter ``WHERE NOT sluice_deleted`` themselves.  Tombstones
are kept for ever, as the region service keeps its own (``region/state.py``):
entry versions continue across a destroy and re-create only because both
sides remember them.

The version rule (``is_newer``), for event ``e`` against the stored ``s``:
``(e.timestamp, e.dsid, e.entry_version) > (s.timestamp, s.dsid,
s.entry_version)``.  That is the order of a key's history at the site whose
queue feeds the table: its region never moves a key's timestamp back, a
remote event applies over another site's version only with a later
timestamp or, on a tie, a higher dsid (Geode's WAN rule, GEODE-FACTS
"Conflicts"), and a local write over another site's version stamps past it
(``region/state.py``).  Entry versions alone do not order the history: an
event from the other site brings that site's entry version, which may be
lower, and the next local write counts on from it (67, then the other
site's 61 and 62, then 63).  A pluggable WAN conflict resolver that keeps
an event with an earlier timestamp is outside this rule.

An equal version is not newer, which is what makes a replay a no-op.

Settings (``listener.settings`` in the site file)::

    url: sqlite:///data/orders.db        # relative to the working directory;
                                          # sqlite:////abs/path.db is absolute;
                                          # or postgresql://user@host:5432/db
    table: orders                         # [schema.]name (schema: PostgreSQL only)
    key_column: key                       # default "key"
    value_column: value                   # default "value": JSONB / JSON text
    region_column: region                 # optional: the key is unique per region
    columns:                              # optional: value fields in own columns
      customer: customer.id               # a dotted path: a text column
      total: {path: totals.sum, type: float}   # text|integer|float|boolean|json
    create_table: true                    # default: create table and view if missing
    timeout_s: 30                         # bound on each database wait

Names are lowercase identifiers, so a name means the same quoted or not.
Columns starting with ``sluice_`` are the listener's: ``sluice_version_dsid``,
``sluice_version_timestamp``, ``sluice_entry_version``, ``sluice_deleted``
and ``sluice_operation``.  A missing path, or a path through something that is
not an object (or a list, for a numeric segment), gives NULL.  A value that
the database refuses for its column's type (``"lots"`` for an integer) is a
dead letter (above).  Keep passwords out of the URL: libpq reads
``PGPASSWORD`` and ``~/.pgpass``.

Threads.  The dispatcher may call ``process_events`` from several dispatcher
threads at once; each call takes a connection of its own from a small pool
(one per concurrent caller), so calls never share a connection.
"""

from __future__ import annotations

import base64
import difflib
import json
import logging
import math
import re
import sqlite3
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson

from ..core import jsonvalue
from ..core.asyncevent import Accepted, AsyncEvent, DeadLetter
from ..core.errors import ClosedError, ConfigError
from ..core.events import CREATES, UPDATES, Operation, VersionTag

__all__ = [
    "COLUMN_TYPES",
    "ColumnMapping",
    "SqlListenerStats",
    "SqlSettings",
    "SqlWriteBehindListener",
    "is_newer",
    "live_view_name",
    "parse_settings",
]

log = logging.getLogger("sluice.listeners.sql")

# --- settings ---------------------------------------------------------------

SETTING_NAMES = ("url", "table", "key_column", "value_column", "region_column", "columns", "create_table", "timeout_s")
COLUMN_SPEC_NAMES = ("path", "type")
TIMEOUT_S_DEFAULT = 30.0

#: Column type in a mapping: (PostgreSQL type, SQLite STRICT type).
COLUMN_TYPES: dict[str, tuple[str, str]] = {
    "text": ("text", "TEXT"),
    "integer": ("bigint", "INTEGER"),
    "float": ("double precision", "REAL"),
    "boolean": ("boolean", "INTEGER"),
    "json": ("jsonb", "TEXT"),
}

#: The listener's own columns; user column names may not start with the prefix.
RESERVED_PREFIX = "sluice_"
VERSION_DSID = "sluice_version_dsid"
VERSION_TIMESTAMP = "sluice_version_timestamp"
ENTRY_VERSION = "sluice_entry_version"
DELETED = "sluice_deleted"
OPERATION = "sluice_operation"
LIVE_VIEW_SUFFIX = "_live"

# Lowercase, so PostgreSQL folds an unquoted reference to the same name; 63 is
# PostgreSQL's identifier limit, less room for the view's suffix.
_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
_NAME_LEN_MAX = 63 - len(LIVE_VIEW_SUFFIX)
_RESERVED_REASON = f"names starting with {RESERVED_PREFIX!r} are the listener's own columns"


@dataclass(frozen=True, slots=True)
class ColumnMapping:
    """One ``columns`` entry: a column filled from a dotted path into the value."""

    name: str
    path: tuple[str, ...]
    type: str


@dataclass(frozen=True, slots=True)
class SqlSettings:
    """Validated ``listener.settings``; ``database`` is the SQLite path or the PostgreSQL URL."""

    url: str
    backend: str  # "sqlite" or "postgresql"
    database: str
    table: str
    schema: str | None
    key_column: str
    value_column: str
    region_column: str | None
    columns: tuple[ColumnMapping, ...]
    create_table: bool
    timeout_s: float

    @property
    def qualified_table(self) -> str:
        return f"{self.schema}.{self.table}" if self.schema else self.table


def live_view_name(table: str) -> str:
    """The view of live rows (no tombstones) created next to ``table``."""
    return table + LIVE_VIEW_SUFFIX


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs and errors)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")
    user = netloc[0].partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[2]}"))


def _field(name: str) -> str:
    return f"listener.settings.{name}"


def _did_you_mean(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f"unknown setting; did you mean {close[0]!r}?"
    return "unknown setting; known: " + ", ".join(choices)


def _name_problem(value: Any) -> str | None:
    if not isinstance(value, str):
        return "must be a string"
    if not _NAME.match(value):
        return "must be lowercase letters, digits and _, not starting with a digit"
    if len(value) > _NAME_LEN_MAX:
        return f"must be at most {_NAME_LEN_MAX} characters"
    return None


def _parse_url(url: Any) -> tuple[str, str] | str:
    """(backend, database) or the reason the URL is wrong."""
    if not isinstance(url, str) or not url:
        return "must be a non-empty string"
    if url.startswith("sqlite:"):
        if not url.startswith("sqlite:///"):
            return "a SQLite URL has no host: sqlite:///relative/path.db or sqlite:////absolute/path.db"
        path = url[len("sqlite:///"):]
        if not path or path.endswith("/"):
            return "names no database file"
        if path == ":memory:":
            return "an in-memory database loses its rows on reconnect; name a file"
        return ("sqlite", path)
    scheme = url.partition(":")[0]
    if scheme in ("postgresql", "postgres"):
        try:
            from psycopg.conninfo import conninfo_to_dict
        except ImportError:
            return "PostgreSQL needs the psycopg package (pip install 'psycopg[binary]==3.3.9')"
        try:
            conninfo_to_dict(url)
        except Exception as exc:  # psycopg.ProgrammingError; imported lazily
            return f"not a valid PostgreSQL URL: {exc}"
        return ("postgresql", url)
    return "the scheme must be sqlite or postgresql"


def _parse_columns(value: Any, problems: list[tuple[str, Any, str]]) -> tuple[ColumnMapping, ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        problems.append((_field("columns"), value, "must be a mapping of column name to a path or {path, type}"))
        return ()
    mappings = []
    for name, spec in value.items():
        where = f"columns.{name}"
        reason = _name_problem(name)
        if reason is None and name.startswith(RESERVED_PREFIX):
            reason = _RESERVED_REASON
        if reason is not None:
            problems.append((_field(where), name, reason))
            continue
        kind = "text"
        if isinstance(spec, Mapping):
            for unknown in sorted(set(spec) - set(COLUMN_SPEC_NAMES), key=str):
                reason = _did_you_mean(str(unknown), COLUMN_SPEC_NAMES)
                problems.append((_field(f"{where}.{unknown}"), spec[unknown], reason))
            kind = spec.get("type", "text")
            if kind not in COLUMN_TYPES:
                problems.append((_field(f"{where}.type"), kind, "must be one of " + ", ".join(COLUMN_TYPES)))
                continue
            path, where = spec.get("path"), f"{where}.path"
        else:
            path = spec
        if not isinstance(path, str) or not path or any(not segment for segment in path.split(".")):
            problems.append((_field(where), path, "must be a dotted path into the value, like 'customer.id'"))
            continue
        mappings.append(ColumnMapping(name, tuple(path.split(".")), kind))
    return tuple(mappings)


def parse_settings(settings: Mapping[str, Any]) -> SqlSettings:
    """Validate ``listener.settings``; raise ``ConfigError`` listing every problem."""
    problems: list[tuple[str, Any, str]] = []
    if not isinstance(settings, Mapping):
        raise ConfigError([("listener.settings", settings, "must be a mapping")])
    for unknown in sorted(set(settings) - set(SETTING_NAMES), key=str):
        problems.append((_field(str(unknown)), settings[unknown], _did_you_mean(str(unknown), SETTING_NAMES)))

    url = settings.get("url")
    parsed = _parse_url(url) if "url" in settings else "is required"
    shown_url = redact_url(url) if isinstance(url, str) else url
    backend: str | None
    if isinstance(parsed, str):
        problems.append((_field("url"), shown_url, parsed))
        backend, database = None, ""
    else:
        backend, database = parsed

    schema: str | None = None
    table = settings.get("table")
    if table is None:
        problems.append((_field("table"), None, "is required"))
    elif isinstance(table, str) and "." in table:
        schema, _, name = table.partition(".")
        reason = _name_problem(schema) or _name_problem(name)
        if reason is None and backend == "sqlite":
            reason = "a schema-qualified table is for PostgreSQL only"
        if reason is not None:
            problems.append((_field("table"), table, reason))
        table = name
    elif (reason := _name_problem(table)) is not None:
        problems.append((_field("table"), table, reason))

    names: dict[str, Any] = {}
    for setting, default in (("key_column", "key"), ("value_column", "value"), ("region_column", None)):
        value = settings.get(setting, default)
        if value is None:
            names[setting] = None
        elif (reason := _name_problem(value)) is not None:
            problems.append((_field(setting), value, reason))
        elif value.startswith(RESERVED_PREFIX):
            problems.append((_field(setting), value, _RESERVED_REASON))
        else:
            names[setting] = value

    columns = _parse_columns(settings.get("columns"), problems)
    seen: dict[str, str] = {}
    for setting in ("key_column", "value_column", "region_column"):
        if names.get(setting) is not None:
            if names[setting] in seen:
                problems.append((_field(setting), names[setting], f"is the same column as {seen[names[setting]]}"))
            seen.setdefault(names[setting], setting)
    for mapping in columns:
        if mapping.name in seen:
            reason = f"is the same column as {seen[mapping.name]}"
            problems.append((_field(f"columns.{mapping.name}"), mapping.name, reason))

    create_table = settings.get("create_table", True)
    if not isinstance(create_table, bool):
        problems.append((_field("create_table"), create_table, "must be true or false"))
    timeout_s = settings.get("timeout_s", TIMEOUT_S_DEFAULT)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        problems.append((_field("timeout_s"), timeout_s, "must be a number of seconds > 0"))

    if problems:
        raise ConfigError(problems)
    assert isinstance(url, str) and isinstance(table, str) and backend is not None
    return SqlSettings(
        url=url, backend=backend, database=database, table=table, schema=schema,
        key_column=names["key_column"], value_column=names["value_column"],
        region_column=names["region_column"], columns=columns,
        create_table=create_table, timeout_s=float(timeout_s),
    )


# --- the version rule ---------------------------------------------------------


def is_newer(event: VersionTag, stored: VersionTag) -> bool:
    """True when ``event`` replaces ``stored`` (the rule in the module docstring)."""
    return (event.timestamp, event.dsid, event.entry_version) > (stored.timestamp, stored.dsid, stored.entry_version)


def _newer_sql(stored: str, incoming: str) -> str:
    """``is_newer`` in SQL, comparing the row ``incoming`` with ``stored`` (a row-value comparison)."""
    columns = (f'"{VERSION_TIMESTAMP}"', f'"{VERSION_DSID}"', f'"{ENTRY_VERSION}"')
    return (f"({', '.join(f'{stored}.{c}' for c in columns)}) < "
            f"({', '.join(f'{incoming}.{c}' for c in columns)})")


# --- rows ------------------------------------------------------------------------

_UPSERTS = CREATES | UPDATES
_DESTROYS = frozenset({Operation.DESTROY, Operation.REMOVEALL_DESTROY, Operation.EXPIRE_DESTROY})
_INVALIDATES = frozenset({Operation.INVALIDATE, Operation.EXPIRE_INVALIDATE})


class _PoisonEvent(Exception):
    """An event whose value cannot be turned into a row (not valid UTF-8 or JSON, a number no column holds)."""

    def __init__(self, event: AsyncEvent, reason: str, error_class: str = "UndecodableValue") -> None:
        self.event = event
        self.reason = reason
        self.error_class = error_class
        super().__init__(f"{event!r}: {reason}")


class _ValueDoesNotFit(Exception):
    """A mapped value no column of its type can hold, found before the database is asked."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


def _json_text(value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))  # integers beyond 64 bits


def _scalar_text(value: Any) -> str | None:
    """A JSON value as the text a column of any type parses (JSON's spelling)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    return _json_text(value)


def _extract(value: Any, path: tuple[str, ...]) -> Any:
    for segment in path:
        if isinstance(value, dict):
            value = value.get(segment)
        elif isinstance(value, list) and segment.isdigit():
            index = int(segment)
            value = value[index] if index < len(value) else None
        else:
            return None
        if value is None:
            return None
    return value


# orjson 3.13 reads an integer beyond 64 bits as a float, silently; the
# stdlib reads it exactly.  Only a run of 19 or more digits can be one
# (jsonvalue.has_long_digits).
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _decode_value(event: AsyncEvent) -> Any:
    raw = event.raw_value
    if raw is None or event.event.value_encoding != "json":
        return event.value
    try:
        return json.loads(raw) if jsonvalue.has_long_digits(raw) else orjson.loads(raw)
    except ValueError as exc:  # orjson.JSONDecodeError, json.JSONDecodeError, UnicodeDecodeError
        raise _PoisonEvent(event, f"value is not JSON: {exc}") from exc


def _value_text(event: AsyncEvent) -> str | None:
    raw = event.raw_value
    if raw is None:
        return None
    if event.event.value_encoding == "json":
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _PoisonEvent(event, f"value is not UTF-8: {exc}") from exc
    # Only JSON is written by the region service today; keep other bytes intact.
    return _json_text({"encoding": event.event.value_encoding, "base64": base64.b64encode(raw).decode("ascii")})


# --- targets ------------------------------------------------------------------------


class _Target:
    """What differs between SQLite and PostgreSQL: connecting, DDL, the upsert."""

    #: Exceptions raised by the driver; anything else is a programming error.
    errors: tuple[type[BaseException], ...] = ()
    #: The driver's exceptions for a row the database refuses for its own data:
    #: offering it again cannot help (see "Events that can never be written").
    refusals: tuple[type[BaseException], ...] = ()

    def __init__(self, settings: SqlSettings, application_name: str) -> None:
        self.settings = settings
        self.application_name = application_name
        s = settings
        self.key_columns = ([s.region_column] if s.region_column else []) + [s.key_column]
        self.data_columns = self.key_columns + [s.value_column] + [m.name for m in s.columns]
        self.columns = self.data_columns + [VERSION_DSID, VERSION_TIMESTAMP, ENTRY_VERSION, DELETED, OPERATION]

    def column_sql_types(self) -> list[tuple[str, str]]:
        raise NotImplementedError

    def mapped_value(self, mapping: ColumnMapping, value: Any) -> Any:
        raise NotImplementedError

    def connect(self) -> Any:
        raise NotImplementedError

    def prepare(self, conn: Any) -> list[str]:
        """Create the table and view when asked; return the missing columns."""
        raise NotImplementedError

    def write(self, conn: Any, rows: list[tuple[Any, ...]]) -> int:
        """Upsert ``rows`` in one transaction; return how many rows changed."""
        raise NotImplementedError

    def is_connection_error(self, exc: BaseException) -> bool:
        raise NotImplementedError

    def recover(self, conn: Any) -> bool:
        """After an error: roll back; False when the connection is unusable."""
        raise NotImplementedError

    def begin(self, conn: Any) -> None:
        """Open a transaction (for the probe)."""
        raise NotImplementedError

    def rollback(self, conn: Any) -> None:
        raise NotImplementedError

    def write_savepoint(self, conn: Any, rows: list[tuple[Any, ...]]) -> None:
        """Upsert ``rows`` under a savepoint of the open transaction; on failure
        the savepoint is rolled back, the transaction stays usable, and the error is raised."""
        raise NotImplementedError

    def describe_refusal(self, exc: BaseException) -> str:
        return " ".join(str(exc).split())

    def refused_rows(self, conn: Any, rows: list[tuple[Any, ...]]) -> list[tuple[int, BaseException]]:
        """The indexes of the ``rows`` the database refuses on their own, and why.

        Halves are written under savepoints, down to the single rows that
        fail alone; the whole transaction is rolled back at the end, so this
        writes nothing.  A transient error is raised as it comes.
        """
        refused: list[tuple[int, BaseException]] = []
        self.begin(conn)
        try:
            parts = [list(range(len(rows)))]
            while parts:
                part = parts.pop()
                try:
                    self.write_savepoint(conn, [rows[i] for i in part])
                except self.refusals as exc:
                    if len(part) == 1:
                        refused.append((part[0], exc))
                    else:
                        # Left half first, in key order, as the batch's statement writes them.
                        middle = len(part) // 2
                        parts += [part[middle:], part[:middle]]
        finally:
            self.rollback(conn)
        return refused

    def close(self, conn: Any) -> None:
        try:
            conn.close()
        except self.errors:
            pass

    def quoted(self, name: str) -> str:
        return f'"{name}"'

    @property
    def table_sql(self) -> str:
        s = self.settings
        return f'"{s.schema}"."{s.table}"' if s.schema else f'"{s.table}"'

    @property
    def view_sql(self) -> str:
        s = self.settings
        view = live_view_name(s.table)
        return f'"{s.schema}"."{view}"' if s.schema else f'"{view}"'

    def create_table_sql(self, suffix: str = "") -> str:
        lines = [f"{self.quoted(name)} {sql_type}" for name, sql_type in self.column_sql_types()]
        lines.append(f"PRIMARY KEY ({', '.join(map(self.quoted, self.key_columns))})")
        return f"CREATE TABLE IF NOT EXISTS {self.table_sql} (\n  " + ",\n  ".join(lines) + f"\n){suffix}"

    def view_select_sql(self) -> str:
        return (f"SELECT {', '.join(map(self.quoted, self.data_columns))} FROM {self.table_sql} "
                f'WHERE NOT "{DELETED}"')

    def upsert_tail_sql(self, stored: str) -> str:
        updated = [c for c in self.columns if c not in self.key_columns]
        sets = ", ".join(f"{self.quoted(c)} = excluded.{self.quoted(c)}" for c in updated)
        return (f"ON CONFLICT ({', '.join(map(self.quoted, self.key_columns))}) DO UPDATE SET {sets} "
                f"WHERE {_newer_sql(stored, 'excluded')}")


class _SqliteTarget(_Target):
    errors = (sqlite3.Error,)
    # A STRICT column refusing a value's type, NOT NULL, CHECK, UNIQUE: all integrity errors.
    refusals = (sqlite3.IntegrityError, sqlite3.DataError)

    def __init__(self, settings: SqlSettings, application_name: str) -> None:
        super().__init__(settings, application_name)
        # STRICT tables (SQLite 3.37) refuse a value of the wrong type, as
        # PostgreSQL does, so a poison row fails the batch on both targets.
        self.strict = sqlite3.sqlite_version_info >= (3, 37, 0)
        placeholders = ", ".join("?" for _ in self.columns)
        self.upsert_sql = (f"INSERT INTO {self.table_sql} AS stored ({', '.join(map(self.quoted, self.columns))}) "
                           f"VALUES ({placeholders}) " + self.upsert_tail_sql("stored"))

    def column_sql_types(self) -> list[tuple[str, str]]:
        s = self.settings
        types = [(c, "TEXT NOT NULL") for c in self.key_columns] + [(s.value_column, "TEXT")]
        types += [(m.name, COLUMN_TYPES[m.type][1]) for m in s.columns]
        return types + [(VERSION_DSID, "INTEGER NOT NULL"), (VERSION_TIMESTAMP, "INTEGER NOT NULL"),
                        (ENTRY_VERSION, "INTEGER NOT NULL"), (DELETED, "INTEGER NOT NULL DEFAULT 0"),
                        (OPERATION, "TEXT NOT NULL")]

    def mapped_value(self, mapping: ColumnMapping, value: Any) -> Any:
        if value is None:
            return None
        if mapping.type == "json":
            return _json_text(value)
        if mapping.type == "text":
            return _scalar_text(value)
        if isinstance(value, (dict, list)):
            return _json_text(value)  # refused by a STRICT numeric column
        if isinstance(value, int) and not isinstance(value, bool) and not _INT64_MIN <= value <= _INT64_MAX:
            # sqlite3 cannot even bind it (OverflowError); a float column takes it as a float.
            if mapping.type == "float":
                return float(value)
            raise _ValueDoesNotFit(f"{value} does not fit the 64-bit {mapping.type} column {mapping.name!r}")
        return value  # STRICT converts "12" to 12 and refuses "lots"

    def connect(self) -> sqlite3.Connection:
        path = Path(self.settings.database)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            # The world's problem, like a database that cannot be opened.
            raise sqlite3.OperationalError(f"cannot create the directory of {path}: {exc}") from exc
        # isolation_level=None: transactions are the explicit BEGIN/COMMIT
        # below.  check_same_thread=False: the pool hands a connection to
        # whichever dispatcher thread asks next, one at a time.
        conn = sqlite3.connect(path, timeout=self.settings.timeout_s, isolation_level=None, check_same_thread=False)
        try:
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            # FULL: a batch the queue removed after COMMIT must survive a power loss.
            conn.execute("PRAGMA synchronous=FULL")
        except sqlite3.Error:
            conn.close()
            raise
        if mode != "wal":
            log.warning("%s: SQLite kept journal mode %r (WAL refused)", path, mode)
        return conn

    def prepare(self, conn: sqlite3.Connection) -> list[str]:
        conn.execute("BEGIN IMMEDIATE")
        if self.settings.create_table:
            conn.execute(self.create_table_sql(" STRICT" if self.strict else ""))
        present = {row[1] for row in conn.execute(f'PRAGMA table_info("{self.settings.table}")')}
        missing = [c for c in self.columns if c not in present]
        if self.settings.create_table and not missing:
            conn.execute(f"DROP VIEW IF EXISTS {self.view_sql}")
            conn.execute(f"CREATE VIEW {self.view_sql} AS {self.view_select_sql()}")
        conn.execute("COMMIT")
        return missing

    def write(self, conn: sqlite3.Connection, rows: list[tuple[Any, ...]]) -> int:
        # IMMEDIATE takes the write lock now (waiting up to timeout_s for
        # another writer), not halfway through the batch.
        conn.execute("BEGIN IMMEDIATE")
        changed = conn.executemany(self.upsert_sql, rows).rowcount
        conn.execute("COMMIT")
        return changed

    def is_connection_error(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.OperationalError)

    def recover(self, conn: sqlite3.Connection) -> bool:
        try:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            conn.execute("SELECT 1")
        except sqlite3.Error:
            return False
        return True

    def begin(self, conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")

    def rollback(self, conn: sqlite3.Connection) -> None:
        if conn.in_transaction:
            conn.execute("ROLLBACK")

    def write_savepoint(self, conn: sqlite3.Connection, rows: list[tuple[Any, ...]]) -> None:
        conn.execute("SAVEPOINT sluice_probe")
        try:
            conn.executemany(self.upsert_sql, rows)
        except sqlite3.Error:
            conn.execute("ROLLBACK TO sluice_probe")
            conn.execute("RELEASE sluice_probe")
            raise
        conn.execute("RELEASE sluice_probe")


class _PostgresTarget(_Target):
    def __init__(self, settings: SqlSettings, application_name: str) -> None:
        super().__init__(settings, application_name)
        import psycopg  # Imported here: SQLite users need not have it.
        from psycopg import errors as pg_errors

        self.psycopg = psycopg
        self.errors = (psycopg.Error,)
        # SQLSTATE class 22 (data exception: a value its type refuses, out of
        # range, a NUL character), 23 (integrity constraint violation) and
        # 54000 (program limit exceeded: a key too long for its index).
        # Not the rest of class 54 (statement too complex), nor 40 (serialization
        # failure, deadlock), 55P03 or 57014 (lock and statement timeouts): those may pass.
        self.refusals = (psycopg.DataError, psycopg.IntegrityError, pg_errors.ProgramLimitExceeded)
        sql_types = dict(self.column_sql_types())
        # Every column travels as one array parameter (binary: psycopg dumps
        # text arrays about four times faster so); unnest turns the arrays
        # back into rows, so a batch is one statement whatever its size.
        # Mapped and value columns travel as text and are cast by the server,
        # so a value of the wrong type fails in the database (the batch
        # rolls back) rather than in the driver.
        arrays, selects = [], []
        for i, column in enumerate(self.columns):
            base_type = sql_types[column].partition(" NOT NULL")[0]
            if column in (VERSION_DSID, VERSION_TIMESTAMP, ENTRY_VERSION, DELETED):
                arrays.append(f"%b::{base_type}[]")
                selects.append(f"u.c{i}")
            else:
                arrays.append("%b::text[]")
                selects.append(f"u.c{i}" if base_type == "text" else f"u.c{i}::{base_type}")
        self.upsert_sql = (
            f"INSERT INTO {self.table_sql} AS stored ({', '.join(map(self.quoted, self.columns))}) "
            f"SELECT {', '.join(selects)} FROM unnest({', '.join(arrays)}) "
            f"AS u({', '.join(f'c{i}' for i in range(len(self.columns)))}) " + self.upsert_tail_sql("stored")
        )

    def column_sql_types(self) -> list[tuple[str, str]]:
        s = self.settings
        types = [(c, "text NOT NULL") for c in self.key_columns] + [(s.value_column, "jsonb")]
        types += [(m.name, COLUMN_TYPES[m.type][0]) for m in s.columns]
        return types + [(VERSION_DSID, "integer NOT NULL"), (VERSION_TIMESTAMP, "bigint NOT NULL"),
                        (ENTRY_VERSION, "bigint NOT NULL"), (DELETED, "boolean NOT NULL DEFAULT false"),
                        (OPERATION, "text NOT NULL")]

    def mapped_value(self, mapping: ColumnMapping, value: Any) -> Any:
        if value is None:
            return None
        return _json_text(value) if mapping.type == "json" else _scalar_text(value)

    def connect(self) -> Any:
        timeout_ms = int(self.settings.timeout_s * 1000)
        return self.psycopg.connect(
            self.settings.database,
            autocommit=False,
            # libpq waits at least 2 s for a connection, whatever is asked.
            connect_timeout=max(2, math.ceil(self.settings.timeout_s)),
            application_name=self.application_name,
            options=f"-c statement_timeout={timeout_ms} -c lock_timeout={timeout_ms}",
        )

    def prepare(self, conn: Any) -> list[str]:
        s = self.settings
        if s.create_table:
            # Two dispatchers starting together would race in CREATE TABLE IF
            # NOT EXISTS (a unique violation in pg_type); the lock makes the
            # second wait and find the table.
            conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"sluice.sql:{s.qualified_table}",))
            conn.execute(self.create_table_sql())
        present = {row[0] for row in conn.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_schema = COALESCE(%s, current_schema()) AND table_name = %s",
            (s.schema, s.table),
        )}
        missing = [c for c in self.columns if c not in present]
        if s.create_table and not missing:
            conn.execute(f"CREATE OR REPLACE VIEW {self.view_sql} AS {self.view_select_sql()}")
        conn.commit()
        return missing

    def write(self, conn: Any, rows: list[tuple[Any, ...]]) -> int:
        arrays = [list(column) for column in zip(*rows, strict=True)]
        with conn.cursor() as cursor:
            cursor.execute(self.upsert_sql, arrays)
            changed = int(cursor.rowcount)
        conn.commit()
        return changed

    def begin(self, conn: Any) -> None:
        pass  # psycopg opens the transaction with the first statement (autocommit is off)

    def rollback(self, conn: Any) -> None:
        conn.rollback()

    def write_savepoint(self, conn: Any, rows: list[tuple[Any, ...]]) -> None:
        arrays = [list(column) for column in zip(*rows, strict=True)]
        conn.execute("SAVEPOINT sluice_probe")
        try:
            with conn.cursor() as cursor:
                cursor.execute(self.upsert_sql, arrays)
        except self.psycopg.Error:
            conn.execute("ROLLBACK TO SAVEPOINT sluice_probe")
            conn.execute("RELEASE SAVEPOINT sluice_probe")
            raise
        conn.execute("RELEASE SAVEPOINT sluice_probe")

    def describe_refusal(self, exc: BaseException) -> str:
        sqlstate = getattr(exc, "sqlstate", None)
        diag = getattr(exc, "diag", None)
        message = getattr(diag, "message_primary", None) or " ".join(str(exc).split())
        detail = getattr(diag, "message_detail", None)
        return f"{message}{f' ({detail})' if detail else ''}{f' [SQLSTATE {sqlstate}]' if sqlstate else ''}"

    def is_connection_error(self, exc: BaseException) -> bool:
        return isinstance(exc, self.psycopg.OperationalError)

    def recover(self, conn: Any) -> bool:
        if conn.closed or conn.broken:
            return False
        try:
            conn.rollback()
        except self.psycopg.Error:
            return False
        return True


# --- the listener -------------------------------------------------------------------


@dataclass(slots=True)
class SqlListenerStats:
    """Counters since ``init``; read them, never write them."""

    batches_written: int = 0
    batches_failed: int = 0
    events: int = 0
    #: Events of operations an async event queue never carries (local, region).
    events_ignored: int = 0
    #: Rows inserted or changed.
    rows_written: int = 0
    #: Keys whose newest event was not newer than the stored row (replays).
    rows_stale: int = 0
    #: Events that can never be written, handed to the dispatcher as dead letters.
    events_dead_lettered: int = 0


class _SchemaMismatch(Exception):
    """The table is missing, or lacks columns the settings need."""

    def __init__(self, table: str, missing: list[str], absent: bool) -> None:
        self.table = table
        self.missing = missing
        super().__init__(f"table {table!r} does not exist and create_table is false" if absent
                         else f"table {table!r} lacks the columns {', '.join(missing)}")


class SqlWriteBehindListener:
    """Write-behind of an async event queue to a SQL table (module docstring).

    Lifecycle::

        NEW --init()--> OPEN --close()--> CLOSED
                         |  process_events(batch) -> True | False
                         '- any number of times, from any dispatcher thread

    ``init`` validates the settings (``ConfigError``), connects, and creates
    or checks the table; when the database cannot be reached yet, that is
    left to the first offer.  ``process_events`` never raises for a database
    problem: it logs, rolls back and returns False, or, for events that can
    never be written and a host that keeps dead letters, writes the rest and
    returns ``Accepted(dead_letters)``.  ``close`` is idempotent;
    ``process_events`` after it raises ``ClosedError``.
    """

    def __init__(self) -> None:
        self.settings: SqlSettings | None = None
        self.stats = SqlListenerStats()
        self._target: _Target | None = None
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        self._prepare_lock = threading.Lock()
        self._prepared = False
        self._closed = False
        self._queue_id = ""
        #: Where the host keeps dead letters; None: it keeps none, so a batch
        #: with an event that can never be written is refused as a whole.
        self._dead_letter_topic: str | None = None

    # --- lifecycle ------------------------------------------------------------

    def init(self, config: Mapping[str, Any]) -> None:
        settings = parse_settings(config.get("settings") or {})
        self._queue_id = str(config.get("queue_id", ""))
        self._dead_letter_topic = config.get("dead_letter_topic") or None
        application_name = f"sluice-sql-{self._queue_id}" if self._queue_id else "sluice-sql"
        target_class = _SqliteTarget if settings.backend == "sqlite" else _PostgresTarget
        self.settings = settings
        self._target = target_class(settings, application_name)
        try:
            conn = self._checkout()
        except _SchemaMismatch as exc:
            raise ConfigError([(_field("table"), settings.qualified_table, str(exc))]) from exc
        except self._target.errors as exc:
            if not self._target.is_connection_error(exc):
                raise ConfigError([(_field("table"), settings.qualified_table, f"cannot be prepared: {exc}")]) from exc
            log.warning("queue %s: %s not reachable yet (%s); the first batch tries again",
                        self._queue_id, redact_url(settings.url), exc)
            return
        self._checkin(conn)
        log.info("queue %s: writing behind to %s table %s", self._queue_id, redact_url(settings.url),
                 settings.qualified_table)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            assert self._target is not None
            self._target.close(conn)

    # --- batches ----------------------------------------------------------------

    def process_events(self, events: list[AsyncEvent]) -> bool | Accepted:
        if self._closed:
            raise ClosedError("SqlWriteBehindListener is closed")
        assert self._target is not None, "process_events() before init()"
        target = self._target
        #: Position in ``events`` -> why that event can never be written.
        rejected: dict[int, DeadLetter] = {}
        conn = None
        try:
            # Each round leaves out at least one more event, or ends.
            while True:
                rows, ignored = self._rows(events, rejected)
                if rejected and self._dead_letter_topic is None:
                    letter = rejected[min(rejected)]
                    log.error("queue %s: batch refused, %r: %s; it is offered again until the event is fixed "
                              "(this host keeps no dead letters)", self._queue_id, letter.event, letter.reason)
                    if conn is not None:
                        self._checkin(conn)
                    self._count(batches_failed=1)
                    return False
                if not rows:
                    changed = 0
                    break
                if conn is None:
                    conn = self._checkout()
                try:
                    changed = target.write(conn, [row for _, row in rows])
                    break
                except target.refusals as exc:
                    if self._dead_letter_topic is None:
                        raise
                    target.rollback(conn)
                    refused = target.refused_rows(conn, [row for _, row in rows])
                    if not refused:
                        raise  # no row fails alone: not one event's fault, so offered again
                    for index, why in refused:
                        position = rows[index][0]
                        rejected[position] = DeadLetter(
                            events[position], f"the database refuses the row: {target.describe_refusal(why)}",
                            type(why).__name__)
        except _SchemaMismatch as exc:
            log.error("queue %s: batch not written: %s", self._queue_id, exc)
            self._count(batches_failed=1)
            return False
        except target.errors as exc:
            self._after_error(conn, exc)
            self._count(batches_failed=1)
            return False
        except BaseException:
            # A bug of ours: never hand on a connection left inside a
            # transaction (in SQLite it would hold the write lock).
            if conn is not None:
                target.close(conn)
            raise
        if conn is not None:
            self._checkin(conn)
        self._count(batches_written=1, events=len(events), events_ignored=ignored,
                    rows_written=changed, rows_stale=len(rows) - changed, events_dead_lettered=len(rejected))
        log.debug("queue %s: batch of %d events, %d rows written, %d stale, %d dead letters", self._queue_id,
                  len(events), changed, len(rows) - changed, len(rejected))
        if not rejected:
            return True
        letters = tuple(rejected[position] for position in sorted(rejected))
        for letter in letters:
            log.error("queue %s: %r can never be written (%s): %s; it goes to %s", self._queue_id, letter.event,
                      letter.error_class, letter.reason, self._dead_letter_topic)
        return Accepted(letters)

    def _rows(self, events: list[AsyncEvent],
              rejected: dict[int, DeadLetter]) -> tuple[list[tuple[int, tuple[Any, ...]]], int]:
        """The newest event per key, leaving out ``rejected``, as (position, row)
        sorted by key; and the count ignored.  An event whose row cannot be
        built is added to ``rejected`` and the key's next newest event taken."""
        by_region = self.settings is not None and self.settings.region_column is not None
        while True:
            newest: dict[Any, tuple[int, AsyncEvent]] = {}
            ignored = 0
            for position, event in enumerate(events):
                op = event.operation
                if op not in _UPSERTS and op not in _DESTROYS and op not in _INVALIDATES:
                    ignored += 1
                    continue
                if position in rejected:
                    continue
                key = (event.region, event.key) if by_region else event.key
                current = newest.get(key)
                if current is None or is_newer(event.version, current[1].version):
                    newest[key] = (position, event)
            rows = []
            for key in sorted(newest):
                position, event = newest[key]
                try:
                    rows.append((position, self._row(event)))
                except _PoisonEvent as exc:
                    rejected[position] = DeadLetter(event, exc.reason, exc.error_class)
            if len(rows) == len(newest):
                return rows, ignored

    def _row(self, event: AsyncEvent) -> tuple[Any, ...]:
        assert self.settings is not None and self._target is not None
        s, op = self.settings, event.operation
        deleted = op in _DESTROYS
        row: list[Any] = [event.region, event.key] if s.region_column else [event.key]
        if op in _UPSERTS:
            row.append(_value_text(event))
            if s.columns:
                value = _decode_value(event)
                try:
                    row.extend(self._target.mapped_value(m, _extract(value, m.path)) for m in s.columns)
                except _ValueDoesNotFit as exc:
                    raise _PoisonEvent(event, exc.reason, "ValueDoesNotFit") from exc
        else:
            row.extend(None for _ in range(1 + len(s.columns)))
        version = event.version
        row += [version.dsid, version.timestamp, version.entry_version, deleted, op.value]
        return tuple(row)

    # --- connections -----------------------------------------------------------

    def _checkout(self) -> Any:
        """An idle connection, or a new one; the table is prepared on first use."""
        assert self._target is not None
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._target.connect()
        try:
            self._ensure_prepared(conn)
        except BaseException:
            self._target.close(conn)
            raise
        return conn

    def _ensure_prepared(self, conn: Any) -> None:
        assert self._target is not None and self.settings is not None
        with self._prepare_lock:
            if self._prepared:
                return
            missing = self._target.prepare(conn)
            if missing:
                absent = len(missing) == len(self._target.columns)
                raise _SchemaMismatch(self.settings.qualified_table, missing, absent)
            self._prepared = True

    def _checkin(self, conn: Any) -> None:
        assert self._target is not None
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return
        self._target.close(conn)

    def _after_error(self, conn: Any, exc: BaseException) -> None:
        """Log, then keep the connection if it rolled back cleanly, else drop it."""
        assert self._target is not None
        log.warning("queue %s: batch rolled back, offered again: %s: %s", self._queue_id, type(exc).__name__, exc)
        # The table may have been dropped or altered underneath: check it
        # again on the next offer, so the log says what is wrong.
        if not self._target.is_connection_error(exc):
            self._prepared = False
        if conn is None:
            return
        if self._target.recover(conn):
            self._checkin(conn)
        else:
            self._target.close(conn)

    def _count(self, **increments: int) -> None:
        with self._lock:
            for name, n in increments.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)
