"""What every section of the site file is built from.

The strict base model (``_Model``) and tuple fields that take a YAML list
(``_seq``); the name patterns and the reason an error gives for each; the
shape of a problem, ``(dotted field path, value, reason)``, and how a field
check (``_invalid``) or a section's rules (``_raise_rules``) report one inside
pydantic's validation; files named relative to the site file; and the small
helpers every rule on plain data uses (``_get`` a value or its default,
``_as_int``, ``_join`` a field to its section, ``_suggest`` a near name).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo
from pydantic_core import PydanticCustomError

Problem = tuple[str, Any, str]
"""(dotted field path, value, reason) — the shape ``ConfigError.problems`` holds."""

SITE_PATTERN = r"^[a-z0-9][a-z0-9-]{0,40}$"
NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]{0,100}$"
# Kafka's legal topic characters; 100 keeps every derived name under Kafka's
# 249-character limit (the longest suffix is "queue.<101 chars>.removals").
TOPIC_PREFIX_PATTERN = r"^[A-Za-z0-9._-]{0,100}$"
# POSIX's portable environment variable names (what Kubernetes' env: accepts).
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"

_PATTERN_REASONS = {
    SITE_PATTERN: "must be 1 to 41 lowercase letters, digits or '-', starting with a letter or digit",
    NAME_PATTERN: "must start with a letter and hold only letters, digits, '_' or '-' (at most 101 characters)",
    TOPIC_PREFIX_PATTERN: "may hold only letters, digits, '.', '_' or '-' (legal Kafka topic characters), at most 100",
    ENV_NAME_PATTERN: "must be an environment variable name: letters, digits and '_', not starting with a digit",
}

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
# "pkg.mod:Class" (attribute path after the colon) or "pkg.mod.Class".
_IMPORT_PATH = re.compile(rf"^{_IDENT}(\.{_IDENT})*(:{_IDENT}(\.{_IDENT})*|\.{_IDENT})$")


def _invalid(reason: str) -> PydanticCustomError:
    """A field-level error whose text is ``reason`` (braces in it are safe)."""
    return PydanticCustomError("sluice_invalid", "{reason}", {"reason": reason})


def _raise_rules(problems: list[Problem]) -> None:
    """Raise a section's rule problems, each naming a field relative to the section."""
    if problems:
        raise PydanticCustomError("sluice_problems", "{count} problem(s)", {"count": len(problems), "problems": problems})


class _Model(BaseModel):
    # strict: no "8" → 8 or "yes" → True coercion (see the package docstring).
    # Sequence fields relax strictness for the container only (``_seq``) so a
    # YAML list can fill a tuple; their items stay strict.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, validate_default=False)


def _seq(default: Any = (), **kwargs: Any) -> Any:
    """A tuple field that accepts a list (YAML and TOML have no tuples)."""
    return Field(default, strict=False, **kwargs)


def check_import_path(value: str) -> str:
    """Accept ``pkg.mod:Class`` or ``pkg.mod.Class``; the target is not imported here."""
    if not _IMPORT_PATH.match(value):
        raise _invalid("must be an import path like 'package.module:ClassName' or 'package.module.ClassName'")
    return value


def _existing_file(value: str, info: ValidationInfo) -> str:
    """``value`` as an absolute path to an existing file, relative to the site file's folder."""
    # Relative paths are taken from the site file's folder, not from wherever
    # the service happens to be started, and stored absolute because
    # librdkafka would resolve them against the working directory.
    base = Path((info.context or {}).get("base_dir") or Path.cwd())
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = base / path
    if not path.is_file():
        raise _invalid(f"no such file: {path}")
    return str(path.resolve())


# --- helpers of the rules on plain data ----------------------------------------
#
# Each rule takes a section as a mapping: the model's dump when the model
# validates it, or the raw file data when something else in the file failed
# (then any value of the wrong type is skipped; the field check reports it).


def _get(section: Mapping[str, Any], model: type[BaseModel], name: str) -> Any:
    """The section's value of ``name``, or the model's default when the section leaves it out."""
    if name in section:
        return section[name]
    return model.model_fields[name].get_default(call_default_factory=True)


def _as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _join(prefix: str, field: str) -> str:
    if not prefix:
        return field
    return prefix + field if field.startswith("[") else f"{prefix}.{field}"


def _suggest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    if choices:
        return "; configured: " + ", ".join(sorted(choices))
    return " (none are configured)"
