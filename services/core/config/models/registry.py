"""A Confluent-compatible schema registry: where it is, how to log in, how subjects are named.

``SchemaRegistryConnection`` is the ``schema_registry:`` block of a writer
that frames its records in Confluent's wire format (``serializer:
confluent``): today the Kafka forwarder's ``listener.settings``.  Its
secrets (a basic-auth password or a bearer token) come from the value, a
file or an environment variable, as every secret of a site file does
(``config/secrets.py``); they are read when the registry client is made,
never shown.  The rules between its fields are functions of plain data
below the model, as in the other sections.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator

from ..base import Problem, _invalid, _Model, _raise_rules
from ..secrets import _secret_source_problems, secret_of
from .secretfields import existing_files, secret_env, secret_file

#: Confluent's subject name strategies, by the names its serializers' settings use.
SubjectNameStrategy = Literal["TopicNameStrategy", "RecordNameStrategy", "TopicRecordNameStrategy"]

SECRETS = ("basic_auth_password", "bearer_token")
#: When those are read from their sources.
READ_BY_CLIENT = "read when the registry client is made"


class SchemaRegistryConnection(_Model):
    """How to reach a Confluent-compatible schema registry, and how subjects are named in it."""

    #: How errors name this block's fields when the client is made.
    _SECTION: ClassVar[str] = "schema_registry"

    url: str = Field(
        description="the registry's base URL, e.g. http://registry:8081 (Confluent), "
        "http://apicurio:8080/apis/ccompat/v6 (Apicurio); several separated by commas",
        json_schema_extra={"confluent": "schema.registry.url"})
    subject_name_strategy: SubjectNameStrategy = Field(
        "TopicNameStrategy", description="how a record's subject is named: TopicNameStrategy '<topic>-value' "
        "(one schema per topic), RecordNameStrategy '<record full name>' (one schema across topics), "
        "TopicRecordNameStrategy '<topic>-<record full name>'",
        json_schema_extra={"confluent": "value.subject.name.strategy"})
    auto_register: bool = Field(
        True, description="true: register the schema in its subject on start (after checking it is compatible "
        "with what the subject holds); false: the schema must be registered already, by whoever owns the "
        "subjects, and the writer only looks its id up", json_schema_extra={"confluent": "auto.register.schemas"})
    basic_auth_username: str | None = Field(
        None, min_length=1, description="HTTP basic authentication: the user (or API key)",
        json_schema_extra={"confluent": "basic.auth.user.info"})
    basic_auth_password: SecretStr | None = Field(
        None, description="HTTP basic authentication: the password (or API secret); with basic_auth_username, "
        "exactly one of basic_auth_password, basic_auth_password_file or basic_auth_password_env")
    basic_auth_password_file: str | None = secret_file("basic_auth_password", READ_BY_CLIENT)
    basic_auth_password_env: str | None = secret_env("basic_auth_password", READ_BY_CLIENT)
    bearer_token: SecretStr | None = Field(
        None, description="a static bearer token sent as 'Authorization: Bearer …' instead of basic "
        "authentication; at most one of bearer_token, bearer_token_file or bearer_token_env",
        json_schema_extra={"confluent": "bearer.auth.token"})
    bearer_token_file: str | None = secret_file("bearer_token", READ_BY_CLIENT)
    bearer_token_env: str | None = secret_env("bearer_token", READ_BY_CLIENT)
    ssl_ca_location: str | None = Field(
        None, description="CA bundle (PEM) that signed an https registry's certificate; relative to the site file",
        json_schema_extra={"confluent": "schema.registry.ssl.ca.location"})
    timeout_s: float = Field(
        10.0, gt=0, le=300, description="bound on one request to the registry, in seconds")

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        urls = [url.strip().rstrip("/") for url in value.split(",")]
        if not value.strip() or any(not url for url in urls):
            raise _invalid("must be http(s)://host[:port][/path], or several separated by commas")
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise _invalid(f"{url!r} is not an http:// or https:// URL with a host")
            if parts.username is not None or parts.password is not None:
                raise _invalid("carries credentials: give them in basic_auth_username and basic_auth_password(_file/"
                               "_env), which are never shown")
            try:
                parts.port
            except ValueError:
                raise _invalid(f"the port of {url!r} must be a number from 1 to 65535") from None
        return ",".join(urls)

    _check_files = existing_files("ssl_ca_location", "basic_auth_password_file", "bearer_token_file")

    @model_validator(mode="after")
    def _check_registry(self) -> SchemaRegistryConnection:
        _raise_rules(_registry_rules(self.model_dump()))
        return self

    def client_settings(self) -> dict[str, Any]:
        """``SchemaRegistryClient`` settings; the only place the registry's secrets are revealed.

        A secret from a file or an environment variable is read here, each
        time, so a client made after a secret is rotated gets the new one.
        """
        settings: dict[str, Any] = {"url": self.url, "timeout": self.timeout_s}
        if self.ssl_ca_location is not None:
            settings["ssl.ca.location"] = self.ssl_ca_location
        password = self._secret("basic_auth_password")
        if self.basic_auth_username is not None and password is not None:
            settings["basic.auth.user.info"] = f"{self.basic_auth_username}:{password}"
        token = self._secret("bearer_token")
        if token is not None:
            settings["bearer.auth.credentials.source"] = "STATIC_TOKEN"
            settings["bearer.auth.token"] = token
            # confluent-kafka sends Confluent Cloud's logical cluster header with
            # every bearer token; a registry that does not know it ignores it.
            settings["bearer.auth.logical.cluster"] = ""
        return settings

    def _secret(self, name: str) -> str | None:
        """The secret ``name`` read now from whichever of its three sources the block gives, or None."""
        return secret_of(self, name, self._SECTION)


def _registry_rules(section: Mapping[str, Any]) -> list[Problem]:
    """One source per secret; a password goes with a user; basic and bearer authentication exclude each other."""
    problems: list[Problem] = []
    for name in SECRETS:
        problems += _secret_source_problems(section, name)
    password_given = any(section.get(f"basic_auth_password{suffix}") is not None for suffix in ("", "_file", "_env"))
    token_given = any(section.get(f"bearer_token{suffix}") is not None for suffix in ("", "_file", "_env"))
    user = section.get("basic_auth_username")
    if user is not None and not password_given:
        problems.append(("basic_auth_username", user, "needs a password: basic_auth_password, basic_auth_password_file "
                         "or basic_auth_password_env"))
    if password_given and user is None:
        problems.append(("basic_auth_username", None, "is required with a basic-auth password"))
    if token_given and (user is not None or password_given):
        problems.append(("bearer_token", "**********", "give basic authentication or a bearer token, not both"))
    return problems
