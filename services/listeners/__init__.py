"""Async event listeners shipped with Sluice.

A listener receives the batches of one async event queue (see
``sluice.core.asyncevent`` for the contract: ``init(config)``,
``process_events(events) -> bool``, ``close()``).  A site file names a
shipped listener by ``listener.type``:

* ``sql``: ``sluice.listeners.sql.SqlWriteBehindListener`` writes every batch
  to a table in SQLite or PostgreSQL, in one database transaction, and is
  idempotent under redelivery (issue 4).
* ``kafka``: ``sluice.listeners.kafka_forwarder`` forwards accepted events to
  a downstream topic.

Any other class is loaded by ``listener.type: python`` and its
``class_path``.
"""

from __future__ import annotations

from .sql import SqlWriteBehindListener

__all__ = ["SqlWriteBehindListener"]
