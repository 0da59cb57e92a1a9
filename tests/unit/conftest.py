"""Fixtures shared by the unit tests."""

from __future__ import annotations

from typing import Any

import pytest
from recorded_clients import Recorded, RecordedAdmin, RecordedConsumer, RecordedProducer

from sluice.core import kafka as core_kafka


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Every Kafka client the code under test makes, as ``(class name, configuration)``, in order."""
    made: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(Recorded, "made", made)
    monkeypatch.setattr(core_kafka, "Producer", RecordedProducer)
    monkeypatch.setattr(core_kafka, "Consumer", RecordedConsumer)
    monkeypatch.setattr(core_kafka, "AdminClient", RecordedAdmin)
    return made
