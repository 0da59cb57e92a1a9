"""A gateway sender and an async event queue share one declaration of their batching fields, yet each
keeps Geode's own defaults and names: batch-time-interval 1000 ms for a sender and 5 ms for a queue, and
Geode's enable-persistence (sender) and persistent (queue) in the generated reference."""

from __future__ import annotations

from typing import Any

from sluice.core.config import AsyncEventQueueConfig, GatewaySenderConfig, parse_config
from sluice.core.configcli import config_reference

#: Geode's defaults of the fields both kinds declare (GEODE-FACTS: the sender's and the queue's tables).
SHARED_DEFAULTS = {"parallel": False, "batch_size": 100, "batch_conflation": False, "dispatcher_threads": 5,
                   "order_policy": "KEY", "maximum_queue_memory_mb": 100}


def site(**queues: Any) -> dict[str, Any]:
    return {
        "site": "a", "dsid": 1, "kafka": {"bootstrap_servers": "127.0.0.1:9092"},
        "regions": [{"name": "orders", "buckets": 4, "gateway_senders": ["to-b"], "async_event_queues": ["jdbc"]}],
        "gateway_senders": [{"id": "to-b", "remote_dsid": 2}],
        "async_event_queues": [{"id": "jdbc", "listener": {"type": "sql", "settings": {"table": "orders"}}}],
        **queues,
    }


def test_each_kind_keeps_geodes_batch_time_interval_and_the_shared_defaults() -> None:
    """A site file that leaves the fields out gets 1000 ms for the sender, 5 ms for the queue, and the
    same Geode defaults for everything else they share."""
    cfg = parse_config(site(), source="site.yaml")
    sender, queue = cfg.sender("to-b"), cfg.queue("jdbc")
    assert sender.batch_time_interval_ms == 1000
    assert queue.batch_time_interval_ms == 5
    for name, default in SHARED_DEFAULTS.items():
        assert getattr(sender, name) == default == getattr(queue, name), name


def test_the_reference_shows_each_kinds_default_and_geode_name() -> None:
    """The generated reference gives each section its own default and Geode attribute name."""
    text = config_reference()
    senders = text.split("## `gateway_senders[]`", 1)[1].split("\n## ", 1)[0]
    queues = text.split("## `async_event_queues[]`", 1)[1].split("\n## ", 1)[0]
    assert "| `batch_time_interval_ms` | integer | `1000` |" in senders
    assert "| `batch_time_interval_ms` | integer | `5` |" in queues
    assert "| `persistent` | boolean | unset |  | `enable-persistence` |" in senders
    assert "| `persistent` | boolean | unset |  | `persistent` |" in queues


def test_the_defaults_are_declared_on_each_model_not_only_read_from_a_file() -> None:
    """Building the models directly (as tests and ``with_overrides`` do) gives the same defaults."""
    sender = GatewaySenderConfig(id="s", remote_dsid=2)
    queue = AsyncEventQueueConfig(id="q")
    assert (sender.batch_time_interval_ms, queue.batch_time_interval_ms) == (1000, 5)
    fields = GatewaySenderConfig.model_fields
    assert fields["persistent"].json_schema_extra == {"geode": "enable-persistence"}
    assert AsyncEventQueueConfig.model_fields["persistent"].json_schema_extra == {"geode": "persistent"}
