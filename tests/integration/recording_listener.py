"""A listener for tests: records every offer to a JSON-lines file, and can refuse.

Settings: ``path`` (the log), ``fail_first`` (refuse the first N offers of
every batch), ``fail_by`` ("false" to return False, "raise" to raise).
Each line: {"pid", "batch": [first partition, first offset], "attempt",
"accepted", "events": [[partition, offset, key, operation, member, thread,
sequence, possible_duplicate, value], ...]}.
"""

from __future__ import annotations

import json
import os
from typing import Any

from sluice.core.asyncevent import AsyncEvent


class RecordingListener:
    def init(self, config: dict[str, Any]) -> None:
        settings = config["settings"]
        self.path = settings["path"]
        self.fail_first = int(settings.get("fail_first", 0))
        self.fail_by = settings.get("fail_by", "false")
        self.offers: dict[tuple[int, int], int] = {}

    def process_events(self, events: list[AsyncEvent]) -> bool:
        first = (events[0].partition, events[0].offset)
        attempt = self.offers.get(first, 0) + 1
        self.offers[first] = attempt
        accepted = attempt > self.fail_first
        line = {
            "pid": os.getpid(),
            "batch": list(first),
            "attempt": attempt,
            "accepted": accepted,
            "events": [[e.partition, e.offset, e.key, e.operation.value, e.event_id.member_id, e.event_id.thread_id,
                        e.event_id.sequence_id, e.possible_duplicate, e.value] for e in events],
        }
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if not accepted:
            if self.fail_by == "raise":
                raise RuntimeError(f"refusing offer {attempt} of batch {first}")
            return False
        return True

    def close(self) -> None:
        pass


def read_offers(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class RecordingSqlListener:
    """The SQL write-behind listener, also recording what it accepted (``path`` setting)."""

    def init(self, config: dict[str, Any]) -> None:
        from sluice.listeners.sql import SqlWriteBehindListener

        settings = dict(config["settings"])
        self.path = settings.pop("path")
        self.inner = SqlWriteBehindListener()
        self.inner.init({**config, "settings": settings})
        self.calls = 0

    def process_events(self, events: list[AsyncEvent]) -> bool:
        self.calls += 1
        accepted = self.inner.process_events(events)
        line = {
            "pid": os.getpid(),
            "batch": [events[0].partition, events[0].offset],
            "attempt": self.calls,
            "accepted": accepted,
            "events": [[e.partition, e.offset, e.key, e.operation.value, e.event_id.member_id, e.event_id.thread_id,
                        e.event_id.sequence_id, e.possible_duplicate, e.value] for e in events],
        }
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return accepted

    def close(self) -> None:
        self.inner.close()
