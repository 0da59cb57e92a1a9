"""The ``librdkafka:`` passthrough: other librdkafka settings, checked before any client sees them.

A connection (``kafka:``, a gateway sender's ``remote:``, a forwarder's
other cluster) may carry librdkafka properties Sluice has no field for: TLS
details (``ssl.endpoint.identification.algorithm``, ``https.ca.location`` for
an OIDC token endpoint's CA), compression, buffer sizes, ``client.rack``,
``debug``.  Each is checked here, on the file's data, against the table of
every property the installed librdkafka knows
(``sluice.core.librdkafka_properties``, written from the library itself and
compared with it by a unit test):

- an unknown name is refused, with the nearest known one;
- a property Sluice sets itself is refused, saying why (``OWNED``): the
  settings its guarantees rest on (offsets stored only after the work is
  durable, read_committed, idempotence, transactions, the murmur2
  partitioner, its group names), and those a typed field of the section sets
  (``bootstrap_servers``, the SASL and TLS fields), which say where to set it;
- a property set through librdkafka's C API (callbacks, opaque pointers), or
  confluent-kafka's token callback (``CALLBACKS``), is refused: a file cannot
  give one;
- a value of the wrong type, outside the property's range or not one of its
  values is refused.

Producer-only properties reach only producers, consumer-only ones only
consumers, and an admin client gets those of any client
(``sluice.core.kafka``).  The values of ``SECRET_PROPERTIES`` are kept as
``SecretStr`` and never shown, as the section's own secrets.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

from pydantic import SecretStr

from ..librdkafka_properties import PROPERTIES
from .base import Problem

_FIELD = "set it with the section's {field} field"
_GUARANTEE = "Sluice sets it on each client: {why}"

#: Properties Sluice sets itself, each with why and, where a field sets it, which.
OWNED: dict[str, str] = {
    "bootstrap.servers": _FIELD.format(field="bootstrap_servers"),
    "metadata.broker.list": _FIELD.format(field="bootstrap_servers"),
    "security.protocol": _FIELD.format(field="security_protocol"),
    "sasl.mechanism": _FIELD.format(field="sasl_mechanism"),
    "sasl.mechanisms": _FIELD.format(field="sasl_mechanism"),
    "sasl.username": _FIELD.format(field="sasl_username"),
    "sasl.password": _FIELD.format(field="sasl_password (or sasl_password_file, sasl_password_env)"),
    "sasl.oauthbearer.method": _FIELD.format(field="sasl_oauthbearer_method"),
    "enable.sasl.oauthbearer.unsecure.jwt": _FIELD.format(field="sasl_oauthbearer_method (unsecured_jwt)"),
    "sasl.oauthbearer.config": _FIELD.format(field="sasl_oauthbearer_config"),
    "sasl.oauthbearer.client.id": _FIELD.format(field="sasl_oauthbearer_client_id"),
    "sasl.oauthbearer.client.credentials.client.id": _FIELD.format(field="sasl_oauthbearer_client_id"),
    "sasl.oauthbearer.client.secret": _FIELD.format(
        field="sasl_oauthbearer_client_secret (or sasl_oauthbearer_client_secret_file, _env)"),
    "sasl.oauthbearer.client.credentials.client.secret": _FIELD.format(
        field="sasl_oauthbearer_client_secret (or sasl_oauthbearer_client_secret_file, _env)"),
    "sasl.oauthbearer.token.endpoint.url": _FIELD.format(field="sasl_oauthbearer_token_endpoint_url"),
    "sasl.oauthbearer.scope": _FIELD.format(field="sasl_oauthbearer_scope"),
    "sasl.oauthbearer.extensions": _FIELD.format(field="sasl_oauthbearer_extensions"),
    "sasl.kerberos.service.name": _FIELD.format(field="sasl_kerberos_service_name"),
    "sasl.kerberos.principal": _FIELD.format(field="sasl_kerberos_principal"),
    "sasl.kerberos.keytab": _FIELD.format(field="sasl_kerberos_keytab"),
    "sasl.kerberos.kinit.cmd": _FIELD.format(field="sasl_kerberos_kinit_cmd"),
    "ssl.ca.location": _FIELD.format(field="ssl_ca_location"),
    "ssl.certificate.location": _FIELD.format(field="ssl_certificate_location"),
    "ssl.key.location": _FIELD.format(field="ssl_key_location"),
    "ssl.key.password": _FIELD.format(field="ssl_key_password (or ssl_key_password_file, ssl_key_password_env)"),
    "session.timeout.ms": "set it with kafka.session_timeout_ms",
    "heartbeat.interval.ms": "set it with kafka.heartbeat_interval_ms",
    "max.poll.interval.ms": "set it with kafka.max_poll_interval_ms",
    "linger.ms": "set it with kafka.producer_linger_ms",
    "queue.buffering.max.ms": "set it with kafka.producer_linger_ms",
    "delivery.timeout.ms": "set it with kafka.delivery_timeout_ms",
    "message.timeout.ms": "set it with kafka.delivery_timeout_ms",
    "request.timeout.ms": "set it with kafka.request_timeout_ms",
    "group.id": _GUARANTEE.format(why="each consumer group is named after the service and queue it serves"),
    "group.instance.id": _GUARANTEE.format(
        why="one static member id would be shared by every consumer of the process, and failover relies on "
            "dynamic membership"),
    "group.protocol": _GUARANTEE.format(why="its groups' rebalancing protocol is part of their failover"),
    "group.remote.assignor": _GUARANTEE.format(why="its groups' assignment is part of their failover"),
    "partition.assignment.strategy": _GUARANTEE.format(why="its groups' assignment is part of their failover"),
    "enable.auto.commit": _GUARANTEE.format(why="offsets are committed only after the work is durable"),
    "auto.commit.enable": _GUARANTEE.format(why="offsets are committed only after the work is durable"),
    "auto.commit.interval.ms": _GUARANTEE.format(why="offsets are committed only after the work is durable"),
    "enable.auto.offset.store": _GUARANTEE.format(why="offsets are stored only after the work is durable"),
    "offset.store.method": _GUARANTEE.format(why="offsets are kept in Kafka"),
    "auto.offset.reset": _GUARANTEE.format(why="each reader starts where its protocol says"),
    "enable.partition.eof": _GUARANTEE.format(why="its readers find the end of a partition from its offsets"),
    "isolation.level": _GUARANTEE.format(why="its readers see committed records only (its writes are "
                                             "transactional)"),
    "transactional.id": _GUARANTEE.format(why="each transactional writer has its own id, which fences a zombie"),
    "transaction.timeout.ms": _GUARANTEE.format(why="its transactions' timeouts bound a write"),
    "enable.idempotence": _GUARANTEE.format(why="a delivered record is written once and in order"),
    "enable.gapless.guarantee": _GUARANTEE.format(why="a delivered record is written once and in order"),
    "acks": _GUARANTEE.format(why="a delivered record is on every in-sync replica (acks=all)"),
    "request.required.acks": _GUARANTEE.format(why="a delivered record is on every in-sync replica (acks=all)"),
    "max.in.flight.requests.per.connection": _GUARANTEE.format(why="idempotence keeps order with at most 5"),
    "max.in.flight": _GUARANTEE.format(why="idempotence keeps order with at most 5"),
    "partitioner": _GUARANTEE.format(why="records are placed with Kafka's murmur2, as Sluice computes their "
                                         "partitions itself"),
}

#: confluent-kafka's own callables that stand for a login, each with the field that sets it instead.
CALLBACKS: dict[str, str] = {
    "oauth_cb": "is confluent-kafka's token callback, which a file cannot give; Amazon MSK's IAM token is "
                "sasl_oauthbearer_method aws_msk_iam, an OIDC token sasl_oauthbearer_method oidc",
}

#: Secrets librdkafka takes inline: kept as ``SecretStr``, never shown.
SECRET_PROPERTIES = frozenset({
    "ssl.key.pem",
    "ssl.keystore.password",
    "sasl.oauthbearer.assertion.private.key.passphrase",
    "sasl.oauthbearer.assertion.private.key.pem",
})

_SCALAR = (str, int, float, bool)


def passthrough_problems(values: Any) -> list[Problem]:
    """Each problem of a ``librdkafka:`` map, named ``librdkafka.<property>``."""
    if not isinstance(values, Mapping):
        return [("librdkafka", values, "must be a map of librdkafka property names to values")]
    problems: list[Problem] = []
    for name, value in values.items():
        where = f"librdkafka.{name}"
        shown = "**********" if name in SECRET_PROPERTIES else _plain(value)
        if name in CALLBACKS:
            problems.append((where, shown, CALLBACKS[name]))
            continue
        if not isinstance(name, str) or name not in PROPERTIES:
            close = difflib.get_close_matches(str(name), PROPERTIES, n=1, cutoff=0.75)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append((where, shown, f"is not a librdkafka property{hint}"))
            continue
        if name in OWNED:
            problems.append((where, shown, f"cannot be passed through: {OWNED[name]}"))
            continue
        reason = _value_problem(name, value)
        if reason is not None:
            problems.append((where, shown, reason))
    return problems


def passthrough_value(name: str, value: Any) -> Any:
    """The value as the model keeps it: a secret property's as ``SecretStr``."""
    if name in SECRET_PROPERTIES and isinstance(value, str):
        return SecretStr(value)
    return value


def revealed(values: Mapping[str, Any]) -> dict[str, Any]:
    """The map as librdkafka takes it, secrets revealed."""
    return {name: value.get_secret_value() if isinstance(value, SecretStr) else value
            for name, value in values.items()}


def _plain(value: Any) -> Any:
    return value.get_secret_value() if isinstance(value, SecretStr) else value


def _value_problem(name: str, value: Any) -> str | None:
    """Why librdkafka would refuse ``value`` for ``name``, or None."""
    _, kind, allowed = PROPERTIES[name]
    value = _plain(value)
    if kind == "see dedicated API":
        return "is set through librdkafka's C API (a callback or pointer), which a file cannot give"
    if not isinstance(value, _SCALAR):
        return f"must be a single value (a {kind}), not a {type(value).__name__}"
    if kind == "boolean":
        return None if isinstance(value, bool) else "must be true or false"
    if kind in ("integer", "float"):
        numeric = (int,) if kind == "integer" else (int, float)
        if isinstance(value, bool) or not isinstance(value, numeric) or not math.isfinite(value):
            return f"must be a{'n integer' if kind == 'integer' else ' number'}"
        low, _, high = allowed.partition(" .. ")
        if high and not float(low) <= value <= float(high):
            return f"must be from {low} to {high}"
        return None
    if not isinstance(value, str):
        return f"must be text (a {kind})"
    choices = [choice.strip() for choice in allowed.split(",")] if allowed else []
    if kind == "enum value" and value not in choices:
        return f"must be one of {', '.join(choices)}"
    if kind == "CSV flags" and choices:
        unknown = [flag.strip() for flag in value.split(",") if flag.strip() not in choices]
        if unknown:
            return f"{', '.join(unknown)} not known: each flag must be one of {', '.join(choices)}"
    return None
