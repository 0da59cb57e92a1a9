"""What the receivers of a site have done with each inbound partition, carried with the partition.

The gateway receiver writes these figures and ``sluice admin status`` (and the
status page) reads them: the record and its readers are the contract between
the two, so they live in the core.

A receiver process counts what it does (``ReceiverStatus``, its own figures
since it started), but a process may die at any moment and take its counts
with it.  The figures an operator adds up per site are kept per inbound
partition instead, over every owner the partition had, where the partition's
durable state already is: the acks.  The story of one partition's figures:

1. On assignment the owner reads the partition's acks (it does so anyway, to
   rebuild the duplicate-batch tracking) and this site's status topic, and
   starts from the newest ``ReceiverPartitionTotals`` it finds, the one
   covering the highest inbound offset (``newest``): the signed header of an
   ack, or a record keyed ``receiver-partition/<p>`` in the status topic.  It
   names that record's writer as ``carried_from`` and keeps its figures as
   ``carried``, so that what the new owner did itself is ``totals - carried``.
2. Every ack it writes carries the figures with the acked batch counted in
   them, in the header ``sluice-receiver-totals`` (Avro, signed like the ack
   by ``sluice-receiver-totals-signature`` when the site signs): the ack and
   its figures are one record, durable together, so no crash can leave a
   batch acknowledged and uncounted, or counted and not acknowledged.  A
   batch refused whole (rejected, undecodable) has no ack: once its dead
   letter is durable, the figures are written to the status topic, durably,
   before its offset is committed.
3. A batch at or below the offset the figures cover was counted by whoever
   handled it first: read again (a crash before the commit), it is answered
   as before but counted nothing more.
4. The first batch past that offset may have been half applied by the owner
   before, which died before acknowledging it: its events come back from the
   region service as repeats.  They are counted as applied, and as
   ``events_recovered``; so are repeats answered to a request sent again
   after one that got no answer (an owner that applied it but whose answer
   was lost).  A repeat of an event applied by an earlier batch that lands
   in exactly such a request is counted as recovered too: the one figure
   that may be off, by the repeats of at most one batch per takeover.
5. Every few seconds the owner publishes each partition's figures keyed
   ``receiver-partition/<p>`` in the status topic; ``sluice admin status``
   adds them up per site, taking for each partition the newest of that
   record and the header of the partition's last ack, so the figures hold
   even while no receiver runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from .codec import get_codec
from .errors import BadSignature, CodecError
from .kafka import TopicPartition, kafka_errors, make_consumer, read_to_end
from .signing import SIGNATURE_HEADER, SIGNER_HEADER, Headers, Signer, Verifier, site_signer

if TYPE_CHECKING:
    from .config import SiteConfig

#: The figures, in the order of the ``ReceiverCounts`` schema.
COUNTS = ("batches", "duplicate_batches", "rejected_batches", "bad_signatures", "stale_batches", "events_applied",
          "events_recovered", "events_duplicate", "conflicts", "exceptions", "dead_lettered")
#: The ack header carrying the partition's figures, and the one carrying their signature.
TOTALS_HEADER = "sluice-receiver-totals"
TOTALS_SIGNATURE_HEADER = "sluice-receiver-totals-signature"
#: The key of a partition's figures in the site's status topic: this prefix, then the partition.
STATUS_KEY_PREFIX = "receiver-partition/"


def zero() -> dict[str, int]:
    return dict.fromkeys(COUNTS, 0)


@dataclass(frozen=True)
class PartitionTotals:
    """One inbound partition's figures over all its owners (the ``ReceiverPartitionTotals`` record)."""

    partition: int
    dsid: int
    offset: int = -1
    member: str = ""
    owned_since: int = 0
    carried_from: str = ""
    carried: Mapping[str, int] = field(default_factory=zero)
    totals: Mapping[str, int] = field(default_factory=zero)
    updated_at: int = 0

    @property
    def own(self) -> dict[str, int]:
        """What ``member`` did itself: totals minus what it took over."""
        return {name: self.totals[name] - self.carried[name] for name in COUNTS}

    def taken_over_by(self, member: str, now_ms: int) -> "PartitionTotals":
        """The figures a new owner starts from."""
        return replace(self, member=member, owned_since=now_ms, carried_from=self.member, carried=dict(self.totals),
                       updated_at=now_ms)

    def counting(self, offset: int, now_ms: int, **more: int) -> "PartitionTotals":
        """With the batch at ``offset`` counted (``more``: what to add)."""
        assert offset > self.offset, f"offset {offset} is counted already (the figures cover {self.offset})"
        unknown = set(more) - set(COUNTS)
        assert not unknown, f"no such figure: {sorted(unknown)}"
        totals = {name: self.totals[name] + more.get(name, 0) for name in COUNTS}
        return replace(self, offset=offset, totals=totals, updated_at=now_ms)

    def to_record(self) -> dict[str, Any]:
        return {"partition": self.partition, "dsid": self.dsid, "offset": self.offset, "member": self.member,
                "owned_since": self.owned_since, "carried_from": self.carried_from, "carried": dict(self.carried),
                "totals": dict(self.totals), "updated_at": self.updated_at}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "PartitionTotals":
        return cls(record["partition"], record["dsid"], record["offset"], record["member"], record["owned_since"],
                   record["carried_from"], dict(record["carried"]), dict(record["totals"]), record["updated_at"])

    def encode(self) -> bytes:
        # Built from counters and checked values: no validation pass (one record per acknowledged batch).
        return get_codec().encode("ReceiverPartitionTotals", self.to_record(), validate=False)


def newest(found: Iterable[PartitionTotals | None]) -> PartitionTotals | None:
    """The figures covering the highest offset (the latest written among equals), or None."""
    known = [t for t in found if t is not None]
    return max(known, key=lambda t: (t.offset, t.updated_at)) if known else None


def status_key(partition: int) -> bytes:
    return f"{STATUS_KEY_PREFIX}{partition}".encode()


# --- signing: the figures are signed like the records they travel with -----------------------------


def ack_headers(ack_headers: list[tuple[str, bytes]] | None, data: bytes,
                signer: Signer | None) -> list[tuple[str, bytes]]:
    """An ack's headers with the figures ``data`` (and their signature when the site signs) added."""
    headers = list(ack_headers or [])
    headers.append((TOTALS_HEADER, data))
    if signer is not None:
        headers.append((TOTALS_SIGNATURE_HEADER, dict(signer.headers(data))[SIGNATURE_HEADER]))
    return headers


def _header(headers: Headers, name: str) -> bytes | None:
    found = [value for key, value in headers or () if key == name]
    return found[0] if len(found) == 1 else None


def from_ack(headers: Headers, dsid: int, verifier: Verifier | None) -> PartitionTotals | None:
    """The figures an ack of this site (``dsid``) carries, verified when the site signs; None when it
    carries none (an ack of an older release), or none that are its own."""
    data = _header(headers, TOTALS_HEADER)
    if data is None:
        return None
    if verifier is not None:
        signature = _header(headers, TOTALS_SIGNATURE_HEADER)
        if signature is None:
            return None
        try:
            verifier.signer(data, [(SIGNER_HEADER, str(dsid).encode("ascii")), (SIGNATURE_HEADER, signature)])
        except BadSignature:
            return None
    return _decoded(data, dsid)


def from_status(value: bytes | None, headers: Headers, dsid: int, verifier: Verifier | None) -> PartitionTotals | None:
    """The figures of a ``receiver-partition/<p>`` status record, verified when the site signs."""
    if value is None:
        return None
    if verifier is not None:
        try:
            if verifier.signer(value, headers) != dsid:
                return None
        except BadSignature:
            return None
    return _decoded(value, dsid)


def _decoded(data: bytes, dsid: int) -> PartitionTotals | None:
    try:
        totals = PartitionTotals.from_record(get_codec().decode_as("ReceiverPartitionTotals", data))
    except CodecError:
        return None
    return totals if totals.dsid == dsid else None


def own_verifier(cfg: "SiteConfig") -> Verifier | None:
    """A verifier of this site's own signatures; None when the site does not sign."""
    signer = site_signer(cfg)
    return None if signer is None else Verifier({cfg.dsid: [signer.public_key]})


# --- reading them: a new owner, and `sluice admin status` --------------------------------------------


def read_status_totals(cfg: "SiteConfig", consumer: Any, verifier: Verifier | None) -> dict[int, PartitionTotals]:
    """The figures of every inbound partition published in the site's status topic."""
    found: dict[int, PartitionTotals] = {}
    prefix = STATUS_KEY_PREFIX.encode()
    for msg in read_to_end(consumer, cfg.topics.status()):
        key = msg.key() or b""
        if not key.startswith(prefix):
            continue
        totals = from_status(msg.value(), msg.headers(), cfg.dsid, verifier)
        if totals is not None and key == status_key(totals.partition):
            found[totals.partition] = newest([found.get(totals.partition), totals]) or totals
    return found


def last_ack_totals(cfg: "SiteConfig", consumer: Any, partition: int,
                    verifier: Verifier | None) -> PartitionTotals | None:
    """The figures the last record of an acks partition carries (None: none, or not this site's)."""
    topic = cfg.topics.gateway_acks()
    low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
    if high <= low:
        return None
    # The acks are written outside transactions: the record at high - 1 is the last ack.
    for msg in read_to_end(consumer, topic, partition, start=high - 1):
        totals = from_ack(msg.headers(), cfg.dsid, verifier)
        if totals is not None and totals.partition == partition:
            return totals
    return None


def site_totals(cfg: "SiteConfig") -> list[PartitionTotals]:
    """Every inbound partition's figures, the newest of its status record and its last ack's header;
    a partition that none of them names yet has zero figures (``member`` empty)."""
    if cfg.receiver is None:
        return []
    verifier = own_verifier(cfg)
    consumer = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 50})
    try:
        with kafka_errors("reading the receivers' figures per inbound partition"):
            published = read_status_totals(cfg, consumer, verifier)
            md = consumer.list_topics(cfg.topics.gateway_acks(), timeout=10)
            topic = md.topics.get(cfg.topics.gateway_acks())
            acks_partitions = len(topic.partitions) if topic is not None and topic.error is None else 0
            partitions = max(cfg.receiver.inbound_partitions, acks_partitions, max(published, default=-1) + 1)
            rows = []
            for p in range(partitions):
                acked = last_ack_totals(cfg, consumer, p, verifier) if p < acks_partitions else None
                rows.append(newest([published.get(p), acked]) or PartitionTotals(p, cfg.dsid))
            return rows
    finally:
        consumer.close()


def summed(rows: Iterable[PartitionTotals]) -> dict[str, int]:
    """The site's figures: the sum over its inbound partitions."""
    out = zero()
    for row in rows:
        for name in COUNTS:
            out[name] += row.totals[name]
    return out


def now_ms() -> int:
    return int(time.time() * 1000)


__all__ = ["COUNTS", "STATUS_KEY_PREFIX", "TOTALS_HEADER", "TOTALS_SIGNATURE_HEADER", "PartitionTotals",
           "ack_headers", "from_ack", "from_status", "last_ack_totals", "newest", "now_ms", "own_verifier",
           "read_status_totals", "site_totals", "status_key", "summed", "zero"]
