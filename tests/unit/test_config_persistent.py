"""``persistent`` of a gateway sender or an async event queue is refused, whatever its value: a queue is a
Kafka topic, always durable, and a setting that is accepted and changes nothing would mislead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.core.config import EXPIRATION_REFUSED, PERSISTENT_REFUSED, load_config, parse_config
from sluice.core.configcli import config_reference
from sluice.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def site(sender: dict[str, Any] | None = None, queue: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "site": "a", "dsid": 1, "kafka": {"bootstrap_servers": "127.0.0.1:9092"},
        "regions": [{"name": "orders", "buckets": 4, "gateway_senders": ["to-b"], "async_event_queues": ["jdbc"]}],
        "gateway_senders": [{"id": "to-b", "remote_dsid": 2, **(sender or {})}],
        "async_event_queues": [{"id": "jdbc", "listener": {"type": "sql", "settings": {"table": "orders"}},
                                **(queue or {})}],
    }


@pytest.mark.parametrize("value", [True, False, None, "yes"])
@pytest.mark.parametrize("section", ["gateway_senders", "async_event_queues"])
def test_persistent_is_refused_naming_the_field_and_why(section: str, value: Any) -> None:
    """Geode's enable-persistence / persistent, true or false (or anything else), is a ConfigError naming
    the field, the value and the reason, beside the section's other problems."""
    data = site(sender={"persistent": value, "batch_size": 0}) if section == "gateway_senders" else \
        site(queue={"persistent": value, "batch_size": 0})
    with pytest.raises(ConfigError) as caught:
        parse_config(data, source="site.yaml")
    problems = {field: (shown, reason) for field, shown, reason in caught.value.problems}
    assert problems[f"{section}[0].persistent"] == (value, PERSISTENT_REFUSED)
    assert "Kafka topic and always durable" in PERSISTENT_REFUSED and "Remove the setting" in PERSISTENT_REFUSED
    assert f"{section}[0].batch_size" in problems, "the other problems of the section were not reported with it"
    assert f"{section}[0].persistent: not supported, because a queue is a Kafka topic" in str(caught.value)


def test_a_site_without_persistent_loads_and_the_reference_says_why_it_is_refused(tmp_path: Path) -> None:
    """Leaving it out is what a site file does (queues are durable regardless); the generated reference
    lists the field with Geode's names and the reason."""
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(site()))
    cfg = load_config(path)
    assert cfg.sender("to-b").persistent is None and cfg.queue("jdbc").persistent is None
    rows = [line for line in config_reference().splitlines() if line.startswith("| `persistent` |")]
    assert len(rows) == 2 and all("refused, whatever its value" in row for row in rows)
    assert any("`enable-persistence`" in row for row in rows) and any("| `persistent` | boolean" in row for row in rows)


def test_no_site_file_shipped_gives_persistent() -> None:
    """The example sites, the chart's and the benchmarks' files load as they are."""
    found = [p for folder in ("deploy", "helm", "bench", "tests") for p in (ROOT / folder).rglob("*.y*ml")
             if "persistent:" in p.read_text(encoding="utf-8", errors="replace")
             and "gateway_senders" in p.read_text(encoding="utf-8", errors="replace")]
    assert found == [], f"site files giving persistent: {found}"


def test_forwarding_expiration_destroys_is_refused_and_false_is_what_happens() -> None:
    """forward_expiration_destroy true would forward destroys that never happen (regions have no entry
    expiration): a ConfigError naming the field and why; false, Geode's default, loads."""
    with pytest.raises(ConfigError) as caught:
        parse_config(site(queue={"forward_expiration_destroy": True}), source="site.yaml")
    problems = {field: reason for field, _shown, reason in caught.value.problems}
    assert problems["async_event_queues[0].forward_expiration_destroy"] == EXPIRATION_REFUSED
    assert "no entry expiration" in EXPIRATION_REFUSED
    cfg = parse_config(site(queue={"forward_expiration_destroy": False}), source="site.yaml")
    assert cfg.queue("jdbc").forward_expiration_destroy is False
