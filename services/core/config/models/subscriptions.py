"""The subscriptions section: client subscription queues, and the token a client registers with."""

from __future__ import annotations

from typing import Any

from pydantic import Field, SecretStr, ValidationInfo, model_validator

from ..base import _Model
from ..secrets import _resolve_secret
from .secretfields import existing_files, secret_env, secret_file


class SubscriptionsConfig(_Model):
    """Client subscription queues (Geode's client/server messaging defaults)."""

    durable_client_timeout_s: int = Field(
        300, ge=1, description="how long a durable client's queue and durable interest outlive its disconnect; "
        "then they are deleted and an alert is logged", json_schema_extra={"geode": "durable-client-timeout"})
    message_sync_interval_s: int = Field(
        1, ge=1, description="how often a primary checkpoints what it filled and deletes from each queue what "
        "its client acknowledged", json_schema_extra={"geode": "message-sync-interval"})
    message_time_to_live_s: int = Field(
        180, ge=1, description="a non-durable client's queue whose unacknowledged head is older than this is "
        "dropped; the client re-fetches its interest", json_schema_extra={"geode": "message-time-to-live"})
    subscription_message_tracking_timeout_ms: int = Field(
        900000, ge=1, description="how long a client remembers a writer thread's EventIDs to discard repeats",
        json_schema_extra={"geode": "subscription-message-tracking-timeout"})
    subscription_ack_interval_ms: int = Field(
        100, ge=1, description="how often a client acknowledges what it received",
        json_schema_extra={"geode": "subscription-ack-interval"})
    maximum_message_count: int = Field(
        230000, ge=1, description="the most messages a client's queue holds that its client has not acknowledged; "
        "an event that finds it full is not queued (counted), and the client is unregistered with an alert and "
        "resynchronises (a durable client away finds its queue dropped: pending_event_count -1)",
        json_schema_extra={"geode": "maximum-message-count"})
    maximum_time_between_pings_ms: int = Field(
        60000, ge=1, description="a connected client silent this long is taken as crashed",
        json_schema_extra={"geode": "maximum-time-between-pings"})
    ping_interval_ms: int = Field(10000, ge=1, description="how often an idle client pings",
                                  json_schema_extra={"geode": "ping-interval"})
    registry_partitions: int = Field(
        8, ge=1, le=1024, description="partitions of the client registry: the units subscription instances share "
        "as primaries")
    token: SecretStr | None = Field(
        None, description="when set, a client registration (its record on the registry topic) is taken only with "
        "the record header `authorization: Bearer <token>`, and refused with a message to the client otherwise; "
        "the site's clients send it")
    token_file: str | None = secret_file("token")
    token_env: str | None = secret_env("token")

    @model_validator(mode="before")
    @classmethod
    def _read_token(cls, data: Any, info: ValidationInfo) -> Any:
        return _resolve_secret(data, "token", info)

    _check_token_file = existing_files("token_file")
