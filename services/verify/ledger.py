"""A listener that fails now and then and keeps a ledger of what it applied: the fault harness's witness.

``sluice soak`` attaches it to an async event queue (``listener.type: python``,
``class_path: sluice.verify.ledger:LedgerListener``) to check the queue's
contract from the listener's side, as a Geode ``AsyncEventListener`` sees it:

* a batch is applied in one SQLite transaction, appended to the table
  ``applied`` in delivery order (rowid), so the ledger is the listener's
  history for the per-key checker;
* with ``failure_rate`` > 0, that fraction of offers fails (seeded): half of
  them raise, half return False, sometimes after part of the batch was
  written, and the transaction is rolled back, so nothing of a failed offer
  counts.  The queue must offer the very same batch again;
* an event flagged ``possible_duplicate`` whose EventID is in the ledger is
  discarded (counted in ``discarded``), as an idempotent listener does.  An
  event offered again *without* the flag is applied again, and the checker
  reports it as duplicated: the flag is the whole of the contract.

Settings: ``path`` (the SQLite file), ``failure_rate`` (0..1, default 0),
``seed`` (default 0).
"""

from __future__ import annotations

import random
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.asyncevent import AsyncEvent
from ..core.events import EventID, Operation, VersionTag

SCHEMA = """
CREATE TABLE IF NOT EXISTS applied (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  region TEXT NOT NULL, key TEXT NOT NULL, operation TEXT NOT NULL,
  member TEXT NOT NULL, thread INTEGER NOT NULL, sequence INTEGER NOT NULL,
  version_ts INTEGER NOT NULL, version_dsid INTEGER NOT NULL, entry_version INTEGER NOT NULL,
  version_member TEXT NOT NULL, origin_dsid INTEGER NOT NULL, possible_duplicate INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS applied_event ON applied (member, thread, sequence, key);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, n INTEGER NOT NULL);
"""


class InjectedFailure(RuntimeError):
    """The failure a ``LedgerListener`` raises on purpose."""


class LedgerListener:
    """See the module docstring."""

    def init(self, config: dict[str, Any]) -> None:
        settings = config.get("settings", {})
        if "path" not in settings:
            raise ValueError("LedgerListener: settings.path (the ledger's SQLite file) is required")
        rate = float(settings.get("failure_rate", 0.0))
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"LedgerListener: settings.failure_rate {rate} is not in [0, 1)")
        self.failure_rate = rate
        self.rng = random.Random(settings.get("seed", 0))
        self.db = sqlite3.connect(settings["path"], timeout=30, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)

    def process_events(self, events: list[AsyncEvent]) -> bool:
        fail = self.rng.random() < self.failure_rate
        fail_after = self.rng.randrange(len(events) + 1) if fail else -1
        raise_it = self.rng.random() < 0.5
        discarded = 0
        self.db.execute("BEGIN IMMEDIATE")
        try:
            for i, e in enumerate(events):
                if i == fail_after:
                    break
                eid = e.event_id
                if e.possible_duplicate and self.db.execute(
                        "SELECT 1 FROM applied WHERE member=? AND thread=? AND sequence=? AND key=?",
                        (eid.member_id, eid.thread_id, eid.sequence_id, e.key)).fetchone():
                    discarded += 1
                    continue
                v = e.version
                self.db.execute(
                    "INSERT INTO applied (region, key, operation, member, thread, sequence, version_ts, version_dsid,"
                    " entry_version, version_member, origin_dsid, possible_duplicate) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                    (e.region, e.key, e.operation.value, eid.member_id, eid.thread_id, eid.sequence_id,
                     v.timestamp, v.dsid, v.entry_version, v.member_id, e.event.origin_dsid, int(e.possible_duplicate)))
            if fail:
                self.db.execute("ROLLBACK")
                self._count("failures")
                if raise_it:
                    raise InjectedFailure(f"injected listener failure after {fail_after} of {len(events)} events")
                return False
            self.db.execute(
                "INSERT INTO counters (name, n) VALUES ('discarded', ?) ON CONFLICT(name) DO UPDATE SET n = n + ?",
                (discarded, discarded))
            self.db.execute("COMMIT")
            return True
        except InjectedFailure:
            raise
        except BaseException:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise

    def _count(self, name: str) -> None:
        self.db.execute("INSERT INTO counters (name, n) VALUES (?, 1) ON CONFLICT(name) DO UPDATE SET n = n + 1",
                        (name,))

    def close(self) -> None:
        self.db.close()


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One row of the ledger, in the order the listener applied it."""

    region: str
    key: str
    operation: Operation
    event_id: EventID
    version: VersionTag
    origin_dsid: int
    possible_duplicate: bool


def read_ledger(path: Path) -> tuple[list[LedgerEntry], dict[str, int]]:
    """(the applied entries in order, the counters: ``discarded``, ``failures``); empty when there is no ledger."""
    if not path.exists():
        return [], {}
    with sqlite3.connect(path, timeout=30) as db:
        rows = db.execute(
            "SELECT region, key, operation, member, thread, sequence, version_ts, version_dsid, entry_version,"
            " version_member, origin_dsid, possible_duplicate FROM applied ORDER BY seq").fetchall()
        counters = dict(db.execute("SELECT name, n FROM counters").fetchall())
    entries = [LedgerEntry(r[0], r[1], Operation(r[2]), EventID(r[3], r[4], r[5]),
                           VersionTag(r[7], r[6], r[8], r[9]), r[10], bool(r[11]))
               for r in rows]
    return entries, counters
