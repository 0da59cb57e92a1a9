"""The fault harness's ledger listener: a failed offer leaves nothing behind, a flagged repeat is discarded,
an unflagged repeat is applied again (so the history checker sees it as applied twice)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.core.asyncevent import AsyncEvent
from sluice.core.events import EntryEvent, EventID, Operation, VersionTag
from sluice.verify.ledger import InjectedFailure, LedgerListener, read_ledger


def _event(seq: int, duplicate: bool = False) -> AsyncEvent:
    entry = EntryEvent("orders", f"k{seq}", Operation.CREATE, b"1", EventID("w", 1, seq),
                       VersionTag(1, 1_000 + seq, 1, "m"), 1, 0, 1_000 + seq)
    return AsyncEvent(entry, "q", 0, seq, duplicate)


def test_failures_roll_back_and_only_flagged_repeats_are_discarded(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    failing = LedgerListener()
    failing.init({"settings": {"path": str(path), "failure_rate": 0.999, "seed": 3}})
    batch = [_event(i) for i in range(5)]
    outcomes = []
    for _ in range(4):
        try:
            outcomes.append(failing.process_events(batch))
        except InjectedFailure:
            outcomes.append("raised")
    failing.close()
    assert all(o in (False, "raised") for o in outcomes)
    entries, counters = read_ledger(path)
    assert entries == [] and counters["failures"] == 4

    listener = LedgerListener()
    listener.init({"settings": {"path": str(path)}})
    assert listener.process_events(batch)
    assert listener.process_events([_event(0, duplicate=True), _event(5, duplicate=True)])
    assert listener.process_events([_event(1)])  # a repeat without the flag: applied again
    listener.close()
    entries, counters = read_ledger(path)
    assert [e.event_id.sequence_id for e in entries] == [0, 1, 2, 3, 4, 5, 1]
    assert counters["discarded"] == 1
    assert entries[0].version == VersionTag(1, 1_000, 1, "m")


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="settings.path"):
        LedgerListener().init({"settings": {}})
    with pytest.raises(ValueError, match="failure_rate"):
        LedgerListener().init({"settings": {"path": "x.db", "failure_rate": 1.5}})
