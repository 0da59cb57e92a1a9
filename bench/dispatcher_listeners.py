"""Listeners the dispatcher benchmarks run inside the dispatcher process.

The site file names them as ``bench.dispatcher_listeners:CountingListener``
and ``bench.dispatcher_listeners:TimedSqlListener``; the benchmark puts the
repository on the dispatcher's ``PYTHONPATH``.  They live apart from
``bench/dispatcher.py`` so the dispatcher process does not import the
benchmark runner (rich, the registry): its start-up is part of the timed run.

Both write one line per offer to a file of their own (the dispatcher makes
one listener per dispatcher thread, plus one it opens and closes at start)::

    partition first_offset last_offset events possible_duplicates accepted seconds wall_time

``seconds`` is the wall time of ``process_events`` (0 for the no-op
listener), ``wall_time`` is ``time.time()`` when it returned.  The benchmark
reads the lines to check that every record of the queue was accepted exactly
once, and for the listener latency per batch.  A line costs a few
microseconds (one ``write`` per batch, line-buffered).
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

from sluice.listeners.sql import SqlWriteBehindListener

_instances = itertools.count()


class _BatchLog:
    """One listener instance's file of batch lines, opened at its first batch."""

    def __init__(self, directory: str, prefix: str) -> None:
        self._directory = directory
        self._prefix = prefix
        self._file: Any = None

    def write(self, events: list[Any], accepted: bool, seconds: float) -> None:
        if self._file is None:
            name = f"{self._prefix}-{os.getpid()}-{next(_instances)}.batches"
            self._file = open(os.path.join(self._directory, name), "a", buffering=1, encoding="ascii")
        first, last = events[0], events[-1]
        duplicates = sum(1 for e in events if e.possible_duplicate)
        self._file.write(f"{first.partition} {first.offset} {last.offset} {len(events)} {duplicates} "
                         f"{int(accepted)} {seconds:.6f} {time.time():.6f}\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class CountingListener:
    """The no-op listener: accepts every batch at once and counts its events.

    Settings: ``directory`` (where the batch lines go).
    """

    def init(self, config: dict[str, Any]) -> None:
        self.events = 0
        self._log = _BatchLog(config["settings"]["directory"], "noop")

    def process_events(self, events: list[Any]) -> bool:
        self.events += len(events)
        self._log.write(events, True, 0.0)
        return True

    def close(self) -> None:
        self._log.close()


class TimedSqlListener(SqlWriteBehindListener):
    """The built-in SQL write-behind listener, with each ``process_events`` timed.

    Settings: the SQL listener's own, plus ``batch_log_dir`` (taken out
    before the SQL listener validates the rest).
    """

    def init(self, config: dict[str, Any]) -> None:
        settings = dict(config.get("settings") or {})
        self._batch_log = _BatchLog(settings.pop("batch_log_dir"), "sql")
        super().init({**config, "settings": settings})

    def process_events(self, events: list[Any]) -> bool:
        started = time.perf_counter()
        accepted = False
        try:
            accepted = super().process_events(events)
        finally:
            self._batch_log.write(events, accepted, time.perf_counter() - started)
        return accepted

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._batch_log.close()
