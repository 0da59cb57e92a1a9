"""The whole error hierarchy of Sluice.

::

    SluiceError                         root; ``retriable`` says whether another try may help
    ├── ConfigError                     a site file is wrong (carries every problem)
    ├── KeyFormatError                  text that is no Ed25519 key of its kind (also a ValueError)
    ├── CodecError                      a record cannot be read or written
    │   ├── UnknownSchema               unknown fingerprint / schema name
    │   └── MalformedRecord             truncated, bad marker, wrong schema
    ├── InvalidRequest                  bad input from a caller: field, value, reason
    │   ├── UnknownRegion
    │   ├── EntryTooLarge
    │   ├── EntryExists                 Geode's EntryExistsException (create)
    │   ├── EntryNotFound               Geode's EntryNotFoundException (destroy, invalidate)
    │   ├── BadSignature                a record not signed by the key of the site it names
    │   ├── RejectedBatch               a gateway batch this site does not apply
    │   │   └── StaleBatch              sent too long ago, or stamped in the future
    │   └── NotStopped                  a clean start of a sender that is not stopped
    ├── NotOwner                        retriable: the bucket is owned elsewhere or moving
    ├── NotOwnedKeys                    retriable: a forwarded read met keys owned elsewhere (keys, found)
    ├── BucketUnavailable               retriable: no owner yet, or the owner is loading
    ├── OwnershipUnconfirmed            retriable: the writer could not prove it still owns the bucket
    ├── KafkaCallFailed                 a Kafka call failed: ``code`` (librdkafka's), ``__cause__``
    │   ├── BrokerUnavailable           retriable as librdkafka says: the world broke the call
    │   │   └── TransactionAbortable    not retriable: the transaction must be aborted before going on
    │   └── KafkaFatal                  not retriable: a fatal librdkafka error, the client must be rebuilt
    ├── TopicMismatch                   an existing topic disagrees with the config
    ├── TopicMissing                    a topic the config implies does not exist
    ├── TablesBehind                    retriable: the subscription tables were not read to their end in time
    ├── BrokerStartError                an embedded broker did not come up
    ├── StoreCorrupt                    a local store entry does not match its CRC, or does not read
    ├── WanCopyRunning                  a wan-copy of the region through the sender already runs (409)
    ├── MemberRefused                   another instance of the site refused a request; ``retriable`` as it said
    ├── DeliveryRefused                 retriable: a listener or a remote site did not take a batch
    ├── RegistryUnavailable             retriable: a schema registry gave no usable answer (url, reason)
    ├── RegistryRefused                 a schema registry refused a subject's schema (subject, reason)
    ├── RegionError                     the region service refused an operation (status, error, reason)
    ├── RegionUnavailable               retriable: no usable answer from the region service
    ├── NoServersAvailable              retriable: no server reachable (Geode's NoAvailableServersException)
    ├── RegistrationRefused             the subscription service refused a client's registration
    ├── CacheWriterAbort                a client's cache writer refused an operation
    ├── ClosedError                     we closed it: the service or client is stopped
    └── IllegalTransition               not retriable: a service asked for a lifecycle move it may not make

    Stopping (a BaseException, not an Exception)
                                        the service is stopping: raised inside a wait, so that
                                        ``except Exception`` cannot swallow it (trio's ``Cancelled``)

Every subclass carries the facts it is about as attributes, and builds its
message from them, so callers read ``exc.field`` rather than parse text.

Every retry loop reads ``retriable`` and nothing else: a retriable error is
tried again within the loop's bound, any other is raised at once (or, where
the protocol says so, the record is dead-lettered or the event refused).
The errors of a Kafka call are made in one place, ``core/kafka.py``
(``kafka_errors``), from librdkafka's own classification; a specific Kafka
error code a caller handles is ``KafkaCallFailed.code``.  An exception class
anywhere else is private to its module and never leaves it.
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


class NotOwnedKeys(SluiceError):
    """A forwarded read met keys whose buckets this instance does not own: ``keys``, and the entries
    it did read (``found``).  ``POST /internal/read`` answers both, and the instance that forwarded
    the read asks again for those keys."""

    retriable = True
    http_status = 421

    def __init__(self, keys: list[str], found: dict[str, Any]) -> None:
        self.keys = keys
        self.found = found
        super().__init__(f"{len(keys)} keys of buckets owned elsewhere")


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


class KafkaCallFailed(SluiceError):
    """A Kafka call failed (core/kafka.py's ``kafka_errors`` made this from librdkafka's error).
    ``__cause__`` holds that error, ``code`` its error code (None when the failure was not one of
    librdkafka's), and ``retriable`` says whether the same call may succeed when made again."""

    def __init__(self, message: str, *, code: int | None = None, retriable: bool | None = None) -> None:
        self.code = code
        if retriable is not None:
            self.retriable = retriable
        super().__init__(message)


class BrokerUnavailable(KafkaCallFailed):
    """A Kafka call failed for a reason outside Sluice (a broker away, a timeout, a refusal);
    retriable unless librdkafka says otherwise."""

    retriable = True
    http_status = 503


class TransactionAbortable(BrokerUnavailable):
    """A call of a transactional producer failed in a way that leaves its transaction to be aborted
    (librdkafka's ``txn_requires_abort()``).  The call itself is not made again; the work may be,
    in a new transaction, once the old one is aborted."""

    retriable = False


class KafkaFatal(KafkaCallFailed):
    """librdkafka reported a fatal error (``code``); the client must be rebuilt."""

    retriable = False
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


class TablesBehind(SluiceError):
    """The subscription registry, acks or checkpoints could not be read to their end in time."""

    retriable = True


class BrokerStartError(SluiceError):
    """An embedded broker could not be started."""


class KeyFormatError(SluiceError, ValueError):
    """Text that is not an Ed25519 key of the expected kind; the message says why."""


class StoreCorrupt(SluiceError):
    """An entry of a local store whose bytes do not match its CRC, or that cannot be read."""


class NotStopped(InvalidRequest):
    """A clean start of a sender that is not stopped (Geode refuses it too)."""

    http_status = 409


class WanCopyRunning(SluiceError):
    """A copy of the region through the sender already runs on this instance (HTTP 409).  ``copy`` is
    the running one (region/wancopy.py's ``WanCopy``)."""

    http_status = 409

    def __init__(self, copy: Any) -> None:
        self.copy = copy
        super().__init__(f"wan-copy {copy.copy_id} of region {copy.region!r} through sender {copy.sender_id!r} is "
                         f"running ({copy.copied:,} of {copy.total:,} entries copied); cancel it first")

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "copy": self.copy.to_dict()}


class MemberRefused(SluiceError):
    """Another instance of the site answered a request between members with a refusal (or with
    nothing usable); ``retriable`` is what the answer said."""

    def __init__(self, message: str, retriable: bool) -> None:
        self.retriable = retriable
        super().__init__(message)


class DeliveryRefused(SluiceError):
    """A batch was not delivered: the listener returned False, or no ack came.  Offered again."""

    retriable = True


class RegistryUnavailable(SluiceError):
    """A schema registry gave no usable answer (no connection, a timeout, a 5xx): worth another try."""

    retriable = True

    def __init__(self, url: str, reason: str) -> None:
        self.url = url
        self.reason = reason
        super().__init__(f"schema registry {url}: {reason}")


class RegistryRefused(SluiceError):
    """A schema registry refused the schema of ``subject`` (incompatible, invalid): no retry changes that."""

    def __init__(self, subject: str, reason: str) -> None:
        self.subject = subject
        self.reason = reason
        super().__init__(f"schema registry refused subject {subject!r}: {reason}")


class ClosedError(SluiceError):
    """The object was closed by us; using it is a bug in the caller."""


class IllegalTransition(SluiceError):
    """A service was asked for a lifecycle move its table does not hold (core/lifecycle.py): started
    twice, started after a stop.  Our own bug, never retried: ``service``, ``current``, ``wanted``."""

    def __init__(self, service: str, current: str, wanted: str) -> None:
        self.service, self.current, self.wanted = service, current, wanted
        super().__init__(f"{service}: {current} → {wanted} is not a lifecycle move (core/lifecycle.py)")


class RegionError(SluiceError):
    """The region service refused an operation: ``status`` (HTTP), ``error`` (the service's error
    name), ``body`` (its answer).  ``retriable`` is what the answer said."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status = status
        self.body = body
        self.error = body.get("error", "Error")
        self.retriable = bool(body.get("retriable", False))
        super().__init__(f"{status} {self.error}: {body.get('message', body)}")


class RegionUnavailable(SluiceError):
    """A request to the region service got no usable answer (no connection, a timeout, a 5xx, an
    answer that is not JSON) or one saying to ask again: worth another try.  What a request raises
    once its retries are spent; ``__cause__`` holds the last cause when there is one."""

    retriable = True
    http_status = 503


class RegistrationRefused(SluiceError):
    """The subscription service refused the client's registration (``subscriptions.token``)."""

    retriable = False

    def __init__(self, client_id: str, reason: str) -> None:
        self.client_id = client_id
        self.reason = reason
        super().__init__(f"client {client_id}: {reason}; give the site's subscriptions token "
                         f"(ClientCache(..., subscription_token=...) or subscriptions.token in the site file)")


class NoServersAvailable(SluiceError):
    """A client could not reach any server for an operation that needs one (Geode's
    NoAvailableServersException): nothing was applied."""

    retriable = True
    http_status = 503


class CacheWriterAbort(SluiceError):
    """A client's cache writer refused an operation: nothing was sent or applied."""

    http_status = 409


class Stopping(BaseException):
    """The service (or client) is stopping: raised inside a wait it cut short (a broker away, a
    backoff, a full producer queue), and caught only at the top of the thread that waited.

    A ``BaseException``, as trio's ``Cancelled``: ``except Exception`` and ``except SluiceError``
    cannot swallow it, so a stop is never taken for a failure and retried.  ``what`` names the wait."""

    def __init__(self, what: str = "") -> None:
        self.what = what
        super().__init__(f"stopping: {what}" if what else "stopping")
