"""The ``<secret>_file`` and ``<secret>_env`` fields beside every secret of the site file, and the check of
every field naming a file.

Each secret may be given as its value, as a file holding it, or as the name
of an environment variable holding it (config/secrets.py reads the one
given); these build the two source fields the same way for every section,
saying when the source is read.  ``existing_files`` is the validator of a
section's file fields (secret files, certificates, keytabs).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from ..base import ENV_NAME_PATTERN, _existing_file

#: When the tokens and keys the services use are read.
READ_WHEN_LOADED = "read when the site file is loaded"
#: When the Kafka clients' secrets are read: each client made reads its source again.
READ_PER_CLIENT = "read each time a client is made, so a rotated secret is picked up"


def secret_file(secret: str, read: str = READ_WHEN_LOADED) -> Any:
    """The field naming a file that holds ``secret`` (a mounted Kubernetes secret)."""
    return Field(None, description=f"a file holding {secret} (relative to the site file), {read}")


def secret_env(secret: str, read: str = READ_WHEN_LOADED) -> Any:
    """The field naming an environment variable that holds ``secret`` (Kubernetes' secretKeyRef)."""
    return Field(None, pattern=ENV_NAME_PATTERN,
                 description=f"the name of an environment variable holding {secret}, {read}")


def _existing_or_unset(value: str | None, info: ValidationInfo) -> str | None:
    return None if value is None else _existing_file(value, info)


def existing_files(*fields: str) -> Any:
    """The validator of ``fields``: each one given names a file that exists, relative to the site file's
    folder, and is kept as its absolute path."""
    return field_validator(*fields)(_existing_or_unset)
