"""A gateway event filter for tests: ``RecordTransmits.before_transmit`` appends ``[key, possible_duplicate]``
of every event a sender is about to write to the remote site, at every write of its batch, to the file
named by the environment variable ``SLUICE_TEST_TRANSMITS``, and lets the event through."""

from __future__ import annotations

import json
import os

from sluice.core.asyncevent import AsyncEvent


class RecordTransmits:
    def before_transmit(self, event: AsyncEvent) -> bool:
        with open(os.environ["SLUICE_TEST_TRANSMITS"], "a", encoding="utf-8") as f:
            f.write(json.dumps([event.key, event.possible_duplicate]) + "\n")
        return True


def read_transmits(path: str) -> list[tuple[str, bool]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [tuple(json.loads(line)) for line in f if line.strip()]  # type: ignore[misc]
