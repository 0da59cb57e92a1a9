"""The whole error hierarchy of Sluice.

::

    SluiceError                         root; ``retriable`` says whether a retry may help
    ├── ConfigError                     a site file is wrong (carries every problem)
    ├── CodecError                      a record cannot be read or written
    │   ├── UnknownSchema               unknown fingerprint / schema name
    │   └── MalformedRecord             truncated, bad marker, wrong schema
    ├── InvalidRequest                  bad input from a caller: field, value, reason
    │   ├── UnknownRegion
    │   ├── EntryTooLarge
    │   ├── EntryExists                 Geode's EntryExistsException (create)
    │   ├── EntryNotFound               Geode's EntryNotFoundException (destroy, invalidate)
    │   ├── BadSignature                a record not signed by the key of the site it names
    │   └── RejectedBatch               a gateway batch this site does not apply
    │       └── StaleBatch              sent too long ago, or stamped in the future
    ├── NotOwner                        retriable: the bucket is owned elsewhere or moving
    ├── BucketUnavailable               retriable: no owner yet, or the owner is loading
    ├── OwnershipUnconfirmed            retriable: the writer could not prove it still owns the bucket
    ├── BrokerUnavailable               retriable: the world broke a Kafka call (__cause__ set)
    ├── KafkaFatal                      not retriable: a fatal librdkafka error
    ├── TopicMismatch                   an existing topic disagrees with the config
    ├── TopicMissing                    a topic the config implies does not exist
    ├── BrokerStartError                an embedded broker did not come up
    └── ClosedError                     we closed it: the service or client is stopped

Every subclass carries the facts it is about as attributes, and builds its
message from them, so callers read ``exc.field`` rather than parse text.
"""

from __future__ import annotations

from typing import Any


class SluiceError(Exception):
    """Root of every error Sluice raises on purpose."""

    retriable: bool = False
    #: HTTP status used when the error crosses the region service's API.
    http_status: int = 500

    def to_dict(self) -> dict[str, Any]:
        return {"error": type(self).__name__, "message": str(self), "retriable": self.retriable}


class ConfigError(SluiceError):
    """A site configuration is invalid.  ``problems`` lists (field, value, reason)."""

    def __init__(self, problems: list[tuple[str, Any, str]], source: str = "") -> None:
        self.problems = problems
        self.source = source
        lines = [f"{field}: {reason} (got {value!r})" for field, value, reason in problems]
        where = f"{source}: " if source else ""
        super().__init__(where + "; ".join(lines))


class CodecError(SluiceError):
    """A record cannot be encoded or decoded."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class UnknownSchema(CodecError):
    """A fingerprint or schema name that no schema in ``avro/`` has."""


class MalformedRecord(CodecError):
    """Bytes that are not a valid single-object encoded record of a known schema."""


class InvalidRequest(SluiceError):
    """A caller sent something we refuse.  Names the field, the value and why."""

    http_status = 400

    def __init__(self, field: str, value: Any, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        shown = value if not isinstance(value, (bytes, str)) or len(value) <= 80 else f"{value[:80]!r}…"
        super().__init__(f"{field}: {reason} (got {shown!r})")

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d.update(field=self.field, reason=self.reason)
        return d


class UnknownRegion(InvalidRequest):
    http_status = 404

    def __init__(self, region: str) -> None:
        super().__init__("region", region, "no such region in this site's configuration")


class EntryTooLarge(InvalidRequest):
    http_status = 413


class EntryExists(InvalidRequest):
    """Geode's EntryExistsException: create() of a key that is present."""

    http_status = 409

    def __init__(self, region: str, key: str) -> None:
        self.region = region
        self.key = key
        super().__init__("key", key, f"entry already exists in region {region!r}")


class EntryNotFound(InvalidRequest):
    """Geode's EntryNotFoundException: destroy()/invalidate() of an absent key."""

    http_status = 404

    def __init__(self, region: str, key: str) -> None:
        self.region = region
        self.key = key
        super().__init__("key", key, f"no entry in region {region!r}")


class BadSignature(InvalidRequest):
    """A record that is not signed, or not by the key of the site it names; ``field`` is the header
    or record field at fault."""


class RejectedBatch(InvalidRequest):
    """A gateway batch this site does not apply: from a dsid it does not accept, or meant for another one."""


class StaleBatch(RejectedBatch):
    """A gateway batch whose ``created_at`` is older than ``receiver.batch_max_age_ms`` or in the future."""


class NotOwner(SluiceError):
    """This instance does not own the bucket; ask the owner."""

    retriable = True
    http_status = 421

    def __init__(self, region: str, bucket: int, owner: str | None = None) -> None:
        self.region = region
        self.bucket = bucket
        self.owner = owner
        super().__init__(f"bucket {bucket} of region {region!r} is owned by {owner or 'nobody yet'}")


class BucketUnavailable(SluiceError):
    """The bucket has no ready owner (rebalance, load, recovery).  Retry."""

    retriable = True
    http_status = 503

    def __init__(self, region: str, bucket: int, reason: str, retry_after_s: float | None = None) -> None:
        self.region = region
        self.bucket = bucket
        self.reason = reason
        #: When asking again is worth it (the owner's estimate of its load's end); HTTP ``Retry-After``.
        self.retry_after_s = retry_after_s
        super().__init__(f"bucket {bucket} of region {region!r} unavailable: {reason}")

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if self.retry_after_s is not None:
            d["retry_after_s"] = round(self.retry_after_s, 1)
        return d


class OwnershipUnconfirmed(SluiceError):
    """A write may have reached the changelog, but its owner could not confirm
    (by a group commit) that it still owned the bucket: not acknowledged.
    Retry with the same EventID; the current owner answers it."""

    retriable = True
    http_status = 503

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"write not acknowledged: {reason}; retry with the same EventID")


class BrokerUnavailable(SluiceError):
    """A Kafka call failed for a reason outside Sluice.  ``__cause__`` holds it."""

    retriable = True
    http_status = 503


class KafkaFatal(SluiceError):
    """librdkafka reported a fatal error; the client must be rebuilt."""

    http_status = 500


class TopicMismatch(SluiceError):
    """An existing topic does not match what the configuration implies."""

    def __init__(self, topic: str, field: str, expected: Any, actual: Any) -> None:
        self.topic = topic
        self.field = field
        self.expected = expected
        self.actual = actual
        super().__init__(f"topic {topic!r}: {field} is {actual!r}, configuration needs {expected!r}")


class TopicMissing(SluiceError):
    """A topic the configuration implies does not exist yet."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        super().__init__(f"topic {topic!r} does not exist: create the site's topics with `sluice topics apply -c FILE`")


class BrokerStartError(SluiceError):
    """An embedded broker could not be started."""


class ClosedError(SluiceError):
    """The object was closed by us; using it is a bug in the caller."""


class NoServersAvailable(SluiceError):
    """A client could not reach any server for an operation that needs one (Geode's
    NoAvailableServersException): nothing was applied."""

    retriable = True
    http_status = 503


class CacheWriterAbort(SluiceError):
    """A client's cache writer refused an operation: nothing was sent or applied."""

    http_status = 409
