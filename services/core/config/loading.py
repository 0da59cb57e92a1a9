"""Reading a site file: YAML or TOML to a mapping, overrides merged in, validated into a ``SiteConfig``.

``load_config(path)`` reads the file (duplicate YAML keys and syntax errors
become problems with their line); ``parse_config(data)`` validates a mapping
already in memory.  Either raises one ``ConfigError`` listing every problem:
pydantic's, translated (``problems``), and every rule run on the raw data
(``rules``), so the user sees everything at once.
"""

from __future__ import annotations

import copy
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ..errors import ConfigError
from .base import Problem
from .models.site import SiteConfig
from .problems import _dedupe, _problems_from_validation
from .rules import _all_rule_problems


def parse_config(
    data: Any,
    source: str = "",
    *,
    base_dir: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> SiteConfig:
    """Validate ``data`` (a mapping, as read from a site file) into a ``SiteConfig``.

    ``base_dir`` is where relative file paths (TLS material) are looked up:
    the file's folder when loading a file, else the working directory.
    ``overrides`` are deep-merged into ``data`` first (see ``with_overrides``).
    Raises ``ConfigError`` listing every problem.
    """
    if not isinstance(data, Mapping):
        what = "an empty file" if data is None else f"a {type(data).__name__}"
        raise ConfigError([("", _short(data), f"must be a mapping of settings (site:, dsid:, …), not {what}")], source)
    if overrides:
        data = _deep_merge(data, overrides)
    context = {"base_dir": str(base_dir) if base_dir is not None else None}
    try:
        return SiteConfig.model_validate(data, context=context)
    except ValidationError as exc:
        problems = _problems_from_validation(exc)
        # A model's rules only run when all of its own fields are valid; run
        # every rule on the raw data too, so the user sees everything at once.
        problems.extend(_all_rule_problems(data))
        raise ConfigError(_dedupe(problems), source) from None


def load_config(path: str | Path, *, overrides: Mapping[str, Any] | None = None) -> SiteConfig:
    """Read and validate a site file (``.yaml``, ``.yml`` or ``.toml``)."""
    path = Path(path)
    source = str(path)
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise ConfigError([("", source, "unknown file type: a site file ends in .yaml, .yml or .toml")], source)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError([("", source, "no such file")], source) from None
    except OSError as exc:
        raise ConfigError([("", source, f"cannot be read: {exc.strerror or exc}")], source) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([("", f"byte {exc.start}", "is not UTF-8 text")], source) from None

    if suffix == ".toml":
        data = _read_toml(text, source)
        problems: list[Problem] = []
    else:
        data, problems = _read_yaml(text, source)
    try:
        cfg = parse_config(data, source, base_dir=path.parent.resolve(), overrides=overrides)
    except ConfigError as exc:
        raise ConfigError(problems + exc.problems, source) from None
    if problems:
        raise ConfigError(problems, source)
    return cfg


def _read_toml(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        match = re.search(r"\(at line (\d+), column (\d+)\)", message)
        if match:
            line = int(match.group(1))
            reason = message[: match.start()].strip()
            where = f"line {line}, column {match.group(2)}"
            raise ConfigError([(where, _line(text, line), f"TOML syntax error: {reason}")], source) from None
        raise ConfigError([("", None, f"TOML syntax error: {message}")], source) from None


class _Loader(yaml.SafeLoader):
    """SafeLoader that records duplicate keys instead of keeping the last silently."""

    duplicates: list[Problem]

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    self.duplicates.append(
                        (f"line {line}", key, f"duplicate key (first on line {seen[key]}); a key may appear once")
                    )
                else:
                    seen[key] = line
            except TypeError:  # an unhashable key; construct_mapping reports it below
                pass
        return super().construct_mapping(node, deep=deep)


def _read_yaml(text: str, source: str) -> tuple[Any, list[Problem]]:
    loader = _Loader(text)
    loader.duplicates = []
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        reason = f"YAML syntax error: {exc.problem or exc.context or 'unreadable'}"
        if exc.context and exc.problem:
            # The context is where the broken construct began, often the
            # line the user must fix (an unclosed quote found at the end).
            began = f" that starts on line {exc.context_mark.line + 1}" if exc.context_mark else ""
            reason = f"YAML syntax error: {exc.problem} ({exc.context}{began})"
        if mark is None:
            raise ConfigError([("", None, reason)], source) from None
        line = mark.line + 1
        shown = _line(text, line) or (_line(text, exc.context_mark.line + 1) if exc.context_mark else "")
        raise ConfigError([(f"line {line}, column {mark.column + 1}", shown, reason)], source) from None
    except yaml.YAMLError as exc:
        raise ConfigError([("", None, f"YAML syntax error: {exc}")], source) from None
    finally:
        loader.dispose()
    return data, loader.duplicates


def _line(text: str, line: int) -> str:
    lines = text.splitlines()
    return lines[line - 1].strip() if 0 < line <= len(lines) else ""


def _short(value: Any) -> Any:
    text = repr(value)
    return value if len(text) <= 80 else text[:77] + "..."


def _deep_merge(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` with ``changes`` in: mappings merge key by key, anything else (lists too) replaces."""
    out = copy.deepcopy(dict(base))
    for key, value in changes.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
