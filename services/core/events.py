"""The event model: EventID, version tags and entry events (frozen values).

Which operations reach which queues follows Geode:

* gateway senders carry entry create, update (put) and distributed destroy
  only; get, invalidate, local destroy, expiration and region operations
  never cross sites;
* async event queues carry create, update and destroy; an expiration destroy
  only when the queue sets ``forward-expiration-destroy``; invalidates, local
  operations and region operations are not delivered to them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any


class Operation(str, enum.Enum):
    CREATE = "CREATE"
    UPDATE = "UPDATE"
    DESTROY = "DESTROY"
    INVALIDATE = "INVALIDATE"
    PUTALL_CREATE = "PUTALL_CREATE"
    PUTALL_UPDATE = "PUTALL_UPDATE"
    REMOVEALL_DESTROY = "REMOVEALL_DESTROY"
    EXPIRE_DESTROY = "EXPIRE_DESTROY"
    EXPIRE_INVALIDATE = "EXPIRE_INVALIDATE"
    LOCAL_DESTROY = "LOCAL_DESTROY"
    REGION_CLEAR = "REGION_CLEAR"
    REGION_DESTROY = "REGION_DESTROY"
    UNKNOWN = "UNKNOWN"

    @property
    def is_create(self) -> bool:
        return self in CREATES

    @property
    def is_update(self) -> bool:
        return self in UPDATES

    @property
    def is_destroy(self) -> bool:
        return self in DESTROYS

    @property
    def removes_value(self) -> bool:
        """True when the entry has no value afterwards (destroyed or invalid)."""
        return self in DESTROYS or self in (Operation.INVALIDATE, Operation.EXPIRE_INVALIDATE)


CREATES = frozenset({Operation.CREATE, Operation.PUTALL_CREATE})
UPDATES = frozenset({Operation.UPDATE, Operation.PUTALL_UPDATE})
#: A region clear or destroy reaches the changelog as one event per entry, each a tombstone.
REGION_OPERATIONS = frozenset({Operation.REGION_CLEAR, Operation.REGION_DESTROY})
DESTROYS = frozenset({Operation.DESTROY, Operation.REMOVEALL_DESTROY, Operation.EXPIRE_DESTROY, Operation.LOCAL_DESTROY})


_WAN = frozenset({Operation.CREATE, Operation.UPDATE, Operation.DESTROY,
                  Operation.PUTALL_CREATE, Operation.PUTALL_UPDATE, Operation.REMOVEALL_DESTROY})


def goes_to_gateway(op: Operation) -> bool:
    """Only entry create, put and distributed destroy cross sites."""
    return op in _WAN


def goes_to_async_queue(op: Operation, forward_expiration_destroy: bool = False) -> bool:
    """Create, update and destroy; expiration destroy only when forwarded."""
    if op in _WAN:
        return True
    return op is Operation.EXPIRE_DESTROY and forward_expiration_destroy


@dataclass(frozen=True, slots=True, order=True)
class EventID:
    """Geode's EventID: (member, thread, sequence), kept by every retry."""

    member_id: str
    thread_id: int
    sequence_id: int

    @property
    def stream(self) -> tuple[str, int]:
        """The (member, thread) whose sequence this continues."""
        return (self.member_id, self.thread_id)

    def to_record(self) -> dict[str, Any]:
        return {"member_id": self.member_id, "thread_id": self.thread_id, "sequence_id": self.sequence_id}

    @classmethod
    def from_record(cls, r: dict[str, Any]) -> "EventID":
        return cls(r["member_id"], r["thread_id"], r["sequence_id"])

    def __str__(self) -> str:
        return f"{self.member_id}/{self.thread_id}/{self.sequence_id}"


@dataclass(frozen=True, slots=True)
class VersionTag:
    """Entry version stamped by the owner that applied the write."""

    dsid: int
    timestamp: int
    entry_version: int
    member_id: str = ""

    def to_record(self) -> dict[str, Any]:
        return {"dsid": self.dsid, "timestamp": self.timestamp, "entry_version": self.entry_version,
                "member_id": self.member_id}

    @classmethod
    def from_record(cls, r: dict[str, Any]) -> "VersionTag":
        return cls(r["dsid"], r["timestamp"], r["entry_version"], r.get("member_id", ""))


@dataclass(frozen=True, slots=True)
class EntryEvent:
    """One applied operation on one entry: the changelog record and queue payload."""

    region: str
    key: str
    operation: Operation
    value: bytes | None
    event_id: EventID
    version: VersionTag
    origin_dsid: int
    bucket: int
    event_time: int
    callback_argument: str | None = None
    possible_duplicate: bool = False
    visited_dsids: tuple[int, ...] = field(default=())
    value_encoding: str = "json"
    #: (id, last): set on the events of one put_all / remove_all when a
    #: gateway sender of the region groups transaction events.
    transaction: tuple[str, bool] | None = None

    def to_record(self) -> dict[str, Any]:
        return {
            "region": self.region,
            "key": self.key,
            "operation": self.operation.value,
            "value": self.value,
            "value_encoding": self.value_encoding,
            "callback_argument": self.callback_argument,
            "possible_duplicate": self.possible_duplicate,
            "event_id": self.event_id.to_record(),
            "version": self.version.to_record(),
            "origin_dsid": self.origin_dsid,
            "visited_dsids": list(self.visited_dsids),
            "bucket": self.bucket,
            "event_time": self.event_time,
            "transaction": None if self.transaction is None else
            {"id": self.transaction[0], "last": self.transaction[1]},
        }

    @classmethod
    def from_record(cls, r: dict[str, Any]) -> "EntryEvent":
        return cls(
            region=r["region"],
            key=r["key"],
            operation=Operation(r["operation"]),
            value=r["value"],
            event_id=EventID.from_record(r["event_id"]),
            version=VersionTag.from_record(r["version"]),
            origin_dsid=r["origin_dsid"],
            bucket=r["bucket"],
            event_time=r["event_time"],
            callback_argument=r["callback_argument"],
            possible_duplicate=r["possible_duplicate"],
            visited_dsids=tuple(r["visited_dsids"]),
            value_encoding=r.get("value_encoding", "json"),
            transaction=None if r.get("transaction") is None else
            (r["transaction"]["id"], r["transaction"]["last"]),
        )

    def as_possible_duplicate(self) -> "EntryEvent":
        return replace(self, possible_duplicate=True)
