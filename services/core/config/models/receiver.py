"""The receiver section: this site's gateway receiver, the only entry point for remote sites."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, model_validator

from ..base import _Model, _raise_rules, _seq
from ..secrets import _removed_problems


class ReceiverConfig(_Model):
    """This site's gateway receiver: the only entry point for remote sites."""

    inbound_partitions: int = Field(
        8, ge=1, le=1024, description="partitions of this site's inbound topic, which remote senders write "
        "batches to: the receiver's lanes working side by side (Geode: the receiver's port range)")
    accepted_dsids: tuple[Annotated[int, Field(ge=1, le=255)], ...] = _seq(
        description="dsids whose batches are applied; batches from any other site are rejected and counted"
    )
    max_time_between_pings_ms: int = Field(
        60000, ge=1, description="a remote sender none of whose batches reached a receiver process for this long "
        "is shown not connected (sluice admin status, the gauge sluice.gateway.sender.connected) until its next "
        "batch. Senders reach the receiver through Kafka and send nothing while their queue is empty: a batch is "
        "the ping, so an idle sender shows as not connected too",
        json_schema_extra={"geode": "maximum-time-between-pings"})
    manual_start: bool = Field(
        False, description="true: receiver processes start stopped, outside the inbound topic's consumer group, "
        "applying nothing until `sluice admin -c FILE start --receiver` (which `stop --receiver` undoes); the "
        "control topic's last word wins over this at every start", json_schema_extra={"geode": "manual-start"})
    batch_max_age_ms: int = Field(
        86_400_000, ge=1000, description="a batch sent longer ago than this (its created_at; every send, resends "
        "included, stamps it anew) is rejected and dead-lettered, and so is one stamped later than now + "
        "region_service.max_clock_skew_ms: a signed batch recorded from the wire cannot be replayed once the acks "
        "that mark it a duplicate have expired. Keep it below the gateway acks topic's retention")
    apply_events_max: int = Field(
        1000, ge=1, le=10_000, description="the most events the receiver hands the region service in one call; a "
        "larger batch (a sender's batch_size, or a grouped transaction) is applied in several calls, in order, "
        "never refused for its size")

    @model_validator(mode="before")
    @classmethod
    def _refuse_removed(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            _raise_rules([(field.removeprefix("receiver."), value, reason)
                          for field, value, reason in _removed_problems({"receiver": data})])
        return data
