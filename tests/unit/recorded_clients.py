"""Stand-ins for confluent_kafka's clients that keep the configuration each was made with.

The ``recorded`` fixture (tests/unit/conftest.py) puts them in place of the classes core/kafka.py makes
clients from, so a test follows a setting to librdkafka's configuration without a broker.
"""

from __future__ import annotations

from typing import Any


class Recorded:
    """Keeps ``(class name, configuration)`` of every client made, in ``made``."""

    made: list[tuple[str, dict[str, Any]]] = []

    def __init__(self, conf: dict[str, Any]) -> None:
        self.made.append((type(self).__name__, dict(conf)))

    # What a queue primary calls on its consumers while it starts and stops.
    def get_watermark_offsets(self, *_: Any, **__: Any) -> tuple[int, int]:
        return 0, 0

    def assign(self, *_: Any) -> None:
        pass

    def close(self, *_: Any) -> None:
        pass


class RecordedProducer(Recorded):
    pass


class RecordedConsumer(Recorded):
    pass


class RecordedAdmin(Recorded):
    pass
