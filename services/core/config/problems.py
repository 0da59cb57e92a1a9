"""pydantic's validation errors as the project's problems: (dotted field path, value, reason).

``_problems_from_validation`` turns each of pydantic's errors into one
problem with a reason in the site file's words ("must be >= 1", "unknown
key; did you mean 'batch_size'?"), unfolds the lists of problems a section's
rules raised, and hides secret values; ``_dedupe`` drops a problem reported
twice (by a model and again by the sweep over the raw data).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from .base import _PATTERN_REASONS, Problem, _join, _suggest
from .models.site import SiteConfig
from .secrets import _shown


def _path(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _model_at(loc: Sequence[Any]) -> type[BaseModel] | None:
    """The model class that the location ``loc`` (from SiteConfig) points into."""
    model: type[BaseModel] | None = SiteConfig
    for part in loc:
        if isinstance(part, int):
            continue
        if model is None or part not in model.model_fields:
            return None
        model = _model_in(model.model_fields[part].annotation)
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _reason(error: Mapping[str, Any]) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    value = error.get("input")
    if kind == "missing":
        return "is required"
    if kind == "sluice_invalid":
        return ctx["reason"]
    if value is None and kind.endswith("_type"):
        return "has no value (an empty YAML value is null)"
    simple = {
        "greater_than_equal": lambda: f"must be >= {ctx['ge']}",
        "greater_than": lambda: f"must be > {ctx['gt']}",
        "less_than_equal": lambda: f"must be <= {ctx['le']}",
        "less_than": lambda: f"must be < {ctx['lt']}",
        "int_type": lambda: "must be a whole number" + (" (without quotes)" if isinstance(value, str) else ""),
        "int_from_float": lambda: "must be a whole number",
        "float_type": lambda: "must be a number" + (" (without quotes)" if isinstance(value, str) else ""),
        "bool_type": lambda: "must be true or false" + (" (without quotes)" if isinstance(value, str) else ""),
        "string_type": lambda: "must be text",
        "string_pattern_mismatch": lambda: _PATTERN_REASONS.get(ctx.get("pattern"), f"must match {ctx.get('pattern')}"),
        "string_too_short": lambda: "must not be empty" if ctx.get("min_length") == 1 else f"must have at least {ctx['min_length']} characters",
        "string_too_long": lambda: f"must have at most {ctx['max_length']} characters",
        "literal_error": lambda: f"must be one of {ctx['expected']}",
        "enum": lambda: f"must be one of {ctx['expected']}",
        "model_type": lambda: "must be a mapping of settings (key: value)",
        "model_attributes_type": lambda: "must be a mapping of settings (key: value)",
        "dict_type": lambda: "must be a mapping (key: value)",
        "list_type": lambda: "must be a list",
        "tuple_type": lambda: "must be a list",
        "too_short": lambda: f"must have at least {ctx['min_length']} item{'s' if ctx.get('min_length') != 1 else ''}",
        "too_long": lambda: f"must have at most {ctx['max_length']} items",
    }
    if kind in simple:
        return simple[kind]()
    return str(error.get("msg", kind))


def _problems_from_validation(exc: ValidationError) -> list[Problem]:
    """Every error of ``exc`` as problems; an unknown key is looked up in the sections of ``SiteConfig``."""
    problems: list[Problem] = []
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        kind = error["type"]
        where = _path(loc)
        if kind == "sluice_problems":
            for field, value, reason in error["ctx"]["problems"]:
                problems.append((_join(where, field), value, reason))
            continue
        value = error.get("input")
        if kind == "missing":
            value = None
        if kind == "extra_forbidden":
            model = _model_at(loc[:-1])
            key = str(loc[-1])
            known = list(model.model_fields) if model else []
            reason = "unknown key"
            if key.replace("-", "_") in known:
                reason += f"; did you mean {key.replace('-', '_')!r}? (keys use '_', not '-')"
            else:
                reason += _suggest(key, known).replace("; configured: ", "; known keys: ")
            problems.append((where, _shown(key, value), reason))
            continue
        if loc and isinstance(loc[-1], str):
            value = _shown(loc[-1], value)
        problems.append((where, value, _reason(error)))
    return problems


def _dedupe(problems: list[Problem]) -> list[Problem]:
    """``problems`` without a second report of the same field and reason (the first is kept)."""
    out: list[Problem] = []
    seen: set[tuple[str, str]] = set()
    for field, value, reason in problems:
        if (field, reason) not in seen:
            seen.add((field, reason))
            out.append((field, value, reason))
    return out
