"""Listeners are found by type, import path or entry point, with clear errors otherwise."""

from __future__ import annotations

import pytest

from sluice.core.asyncevent import BUILTIN_LISTENERS, load_listener_class
from sluice.core.errors import ConfigError


def test_builtin_listener_types_resolve_to_their_classes() -> None:
    """type: sql and type: kafka name the listeners shipped with Sluice."""
    sql = load_listener_class("sql", None)
    assert sql.__name__ == "SqlWriteBehindListener"
    assert set(BUILTIN_LISTENERS) == {"sql", "kafka"}


@pytest.mark.parametrize("path", ["sluice.listeners.sql:SqlWriteBehindListener",
                                  "sluice.listeners.sql.SqlWriteBehindListener"])
def test_a_python_listener_loads_by_module_colon_class_or_dotted_path(path: str) -> None:
    """Both 'module:Class' and 'module.Class' load a listener class."""
    assert load_listener_class("python", path).__name__ == "SqlWriteBehindListener"


@pytest.mark.parametrize(("path", "reason"), [
    (None, "required for a python listener"),
    ("no.such.module:Listener", "cannot import"),
    ("sluice.listeners.sql:NoSuchClass", "cannot import"),
    ("json:JSONDecoder", "has no process_events() method"),
    ("nosuchentrypoint", "no entry point named so"),
])
def test_a_listener_that_cannot_be_loaded_is_a_config_error_naming_it(path: str | None, reason: str) -> None:
    """A wrong class path fails with listener.class_path, the value and why."""
    with pytest.raises(ConfigError) as info:
        load_listener_class("python", path)
    field, value, why = info.value.problems[0]
    assert field == "listener.class_path" and reason in why
