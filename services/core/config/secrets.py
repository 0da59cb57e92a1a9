"""Secrets: where each comes from, and that none is ever shown.

Every secret X of a site file (the fields in ``_SECRET_FIELDS``) may come
from one of three sources, whichever suits the deployment:

- ``X``: the value, in the site file itself (then keep the file secret);
- ``X_file``: a file holding it (a mounted Kubernetes secret), relative to the
  site file: its content without the trailing newline;
- ``X_env``: the name of an environment variable holding it (Kubernetes'
  ``env.valueFrom.secretKeyRef``), which must be set and not empty.

Giving two is an error.  The Kafka secrets (the SASL password, the OAuth
client secret, the TLS key's password) are read from their source each
time a client is made (``KafkaConnection.client_settings``), so a rotated
mounted secret reaches the next client; the services' tokens and
gateway_private_key are read once, when the file is loaded (a service reads
them when it starts).  Either way a source that cannot be read is a
``ConfigError`` naming the field and the file or variable, and the value is
never shown: ``SecretStr`` masks it in reprs and ``_shown`` in errors.  The
other sites' public keys are not secret: gateway_public_keys (dsid → key) has
the map gateway_public_keys_file (dsid → file) beside it, each dsid in one of
them.  Settings removed from the site file (the old shared signing keys) are
refused here too, each with what replaced it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import SecretStr, ValidationInfo
from pydantic_core import PydanticCustomError

from ..errors import ConfigError
from .base import ENV_NAME_PATTERN, Problem, _existing_file, _raise_rules
from .librdkafka import SECRET_PROPERTIES

#: Fields whose values are never shown, not even in an error.  Each may
#: instead be given as ``<field>_file`` (a file holding it) or ``<field>_env``
#: (the name of an environment variable holding it): see the module docstring.
_SECRET_FIELDS = frozenset({"sasl_password", "ssl_key_password", "sasl_oauthbearer_client_secret", "token",
                            "member_token", "gateway_private_key", "basic_auth_password", "bearer_token",
                            # Removed settings, still never shown when a file gives them.
                            "gateway_signing_key", "sender_keys",
                            # librdkafka's inline secrets, as a connection's librdkafka: map names them.
                            *SECRET_PROPERTIES})
_HIDDEN = "**********"


def _shown(field: str, value: Any) -> Any:
    """The value as an error message may show it: secrets hidden, also inside a section."""
    if field in _SECRET_FIELDS or isinstance(value, SecretStr):
        return _HIDDEN
    if isinstance(value, Mapping):
        return {k: _shown(str(k), v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_shown("", v) for v in value)
    return value


def _read_secret(path: str, field: str) -> str:
    """A secret kept in a file: its content without the trailing newline."""
    try:
        value = Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except OSError as exc:
        raise ConfigError([(field, path, f"cannot be read: {exc.strerror or exc}")]) from None
    if not value:
        raise ConfigError([(field, path, "the file is empty")])
    return value


def _read_env(variable: str, field: str) -> str:
    """A secret kept in the environment variable ``variable``, without a trailing newline."""
    value = os.environ.get(variable)
    if value is None:
        raise ConfigError([(field, variable, f"the environment variable {variable} is not set")])
    value = value.rstrip("\r\n")
    if not value:
        raise ConfigError([(field, variable, f"the environment variable {variable} is empty")])
    return value


def secret_of(model: Any, name: str, section: str) -> str | None:
    """The secret ``name`` of a model read now from whichever of its three sources it gives
    (``name``, ``name_file``, ``name_env``), or None when it gives none."""
    value: SecretStr | None = getattr(model, name)
    if value is not None:
        return value.get_secret_value()
    path: str | None = getattr(model, f"{name}_file")
    if path is not None:
        return _read_secret(path, f"{section}.{name}_file")
    variable: str | None = getattr(model, f"{name}_env")
    if variable is not None:
        return _read_env(variable, f"{section}.{name}_env")
    return None


def _secret_source_problems(section: Mapping[str, Any], name: str) -> list[Problem]:
    """At most one source for the secret ``name``, and its environment variable set.

    The file's existence is checked by the field itself; the variable is
    checked here so that ``sluice config check`` run where the service runs
    (the chart's init step) finds a missing one before the service does.
    """
    sources = (name, f"{name}_file", f"{name}_env")
    given = [source for source in sources if section.get(source) is not None]
    problems: list[Problem] = []
    if len(given) == 2:
        problems.append((given[1], section[given[1]], f"give {given[0]} or {given[1]}, not both"))
    elif len(given) == 3:
        problems.append((given[2], section[given[2]], f"give one of {', '.join(sources)}, not several"))
    variable = section.get(f"{name}_env")
    if isinstance(variable, str) and re.match(ENV_NAME_PATTERN, variable):
        try:
            _read_env(variable, f"{name}_env")
        except ConfigError as exc:
            problems.extend(exc.problems)
    return problems


def _resolve_secret(data: Any, name: str, info: ValidationInfo) -> Any:
    """``data`` with the secret ``name`` read from ``name_file`` or ``name_env`` when one is given.

    For a model's before-validator: the value lands in the field the services
    read, so they need not know where it came from.  A value of the wrong type
    is left for the field's own check to report.
    """
    if not isinstance(data, Mapping):
        return data
    _raise_rules(_secret_source_problems(data, name))
    path, variable = data.get(f"{name}_file"), data.get(f"{name}_env")
    try:
        if isinstance(path, str):
            return {**data, name: _read_secret(_existing_file(path, info), f"{name}_file")}
        if isinstance(variable, str) and re.match(ENV_NAME_PATTERN, variable):
            return {**data, name: _read_env(variable, f"{name}_env")}
    except PydanticCustomError as exc:  # _existing_file: no such file
        _raise_rules([(f"{name}_file", path, str(exc))])
    except ConfigError as exc:
        _raise_rules(exc.problems)
    return data


_PUBLIC_KEY_MAPS = ("gateway_public_keys", "gateway_public_keys_file")


def _resolve_public_keys(data: Any, info: ValidationInfo) -> Any:
    """The site's ``data`` with gateway_public_keys completed from gateway_public_keys_file."""
    if not isinstance(data, Mapping):
        return data
    data = {name: _by_dsid(value) if name in _PUBLIC_KEY_MAPS else value for name, value in data.items()}
    keys, files = (data.get(name) for name in _PUBLIC_KEY_MAPS)
    if not all(value is None or isinstance(value, Mapping) for value in (keys, files)) or not files:
        return data  # the fields' own checks report a map that is not one
    _raise_rules(_public_key_problems(data))
    merged = dict(keys or {})
    problems: list[Problem] = []
    # A dsid that is not a number, or a path that is not text, is left for the field's own check to report.
    for dsid, path in files.items():
        if isinstance(dsid, int) and isinstance(path, str):
            try:
                merged[dsid] = _read_secret(_existing_file(path, info), f"gateway_public_keys_file[{dsid}]")
            except PydanticCustomError as exc:  # _existing_file: no such file
                problems.append((f"gateway_public_keys_file[{dsid}]", path, str(exc)))
            except ConfigError as exc:
                problems.extend(exc.problems)
    _raise_rules(problems)
    return {**data, "gateway_public_keys": merged}


def _public_key_problems(section: Mapping[str, Any]) -> list[Problem]:
    """Each dsid's public key given once, in gateway_public_keys or gateway_public_keys_file."""
    maps = [(name, section.get(name)) for name in _PUBLIC_KEY_MAPS]
    if any(value is not None and not isinstance(value, Mapping) for _, value in maps):
        return []  # the field's own check reports a map that is not one
    given_in: dict[Any, str] = {}
    problems: list[Problem] = []
    for name, sources in maps:
        for dsid, source in (sources or {}).items():
            if _dsid_key(dsid) in given_in:
                problems.append((f"{name}[{dsid}]", source, f"dsid {dsid} already has its key in "
                                 f"{given_in[_dsid_key(dsid)]}; give each dsid's key once"))
                continue
            given_in[_dsid_key(dsid)] = name
    return problems


#: Settings a site file may no longer give, each with what replaced it.
_REMOVED = {
    "gateway_signing_key": "gateway batches are signed with the site's Ed25519 key: set gateway_private_key "
                           "(`sluice keys generate`) and give the other sites its public key in their "
                           "gateway_public_keys",
    "receiver.sender_keys": "the receiver verifies batches with the sending sites' Ed25519 public keys: "
                            "give them in gateway_public_keys (dsid -> key) at the top of the site file",
}


def _removed_problems(data: Mapping[str, Any]) -> list[Problem]:
    """A problem for each removed setting the raw file data still gives."""
    problems: list[Problem] = []
    for name in ("gateway_signing_key", "gateway_signing_key_file", "gateway_signing_key_env"):
        if name in data:
            problems.append((name, _shown("gateway_signing_key", data[name]),
                             f"was removed: {_REMOVED['gateway_signing_key']}"))
    receiver = data.get("receiver")
    if isinstance(receiver, Mapping):
        for name in ("sender_keys", "sender_keys_file", "sender_keys_env"):
            if name in receiver:
                problems.append((f"receiver.{name}", _shown("sender_keys", receiver[name]),
                                 f"was removed: {_REMOVED['receiver.sender_keys']}"))
    return problems


def _by_dsid(value: Any) -> Any:
    """A map keyed by dsid with TOML's string keys ("2", TOML has no other) made numbers."""
    return {_dsid_key(k): v for k, v in value.items()} if isinstance(value, Mapping) else value


def _dsid_key(dsid: Any) -> Any:
    """A dsid as YAML (1) and TOML ("1") write a map key, made comparable."""
    return int(dsid) if isinstance(dsid, str) and dsid.isdigit() else dsid


def _without_loaded_secrets(data: dict[str, Any]) -> dict[str, Any]:
    """A SiteConfig dump without the secrets read from a file or variable, which validation reads again."""
    def without_loaded(section: dict[str, Any], name: str) -> dict[str, Any]:
        if section.get(f"{name}_file") is not None or section.get(f"{name}_env") is not None:
            return {k: v for k, v in section.items() if k != name}
        return section

    data = without_loaded(dict(data), "gateway_private_key")
    if isinstance(data.get("gateway_public_keys"), dict):
        loaded = set(data.get("gateway_public_keys_file") or {})
        data["gateway_public_keys"] = {dsid: key for dsid, key in data["gateway_public_keys"].items()
                                       if dsid not in loaded}
    for section, names in (("region_service", ("token", "member_token")), ("subscriptions", ("token",))):
        if isinstance(data.get(section), dict):
            for name in names:
                data[section] = without_loaded(data[section], name)
    return data
