"""What a receiver reads when it is assigned inbound partitions, before their lanes start (service.py,
step 2 and step 4): the acks this site already wrote, from which the duplicate-batch tracking is rebuilt,
and the partitions' figures, carried in the acks' headers and in the status topic (receivertotals.py).

Only the acks signed with this site's own key count: whoever else can write the acks topic must not make
the receiver take a sender partition's next batches for repeats and drop them."""

from __future__ import annotations

import collections

from ..core import receivertotals as figures_of
from ..core.codec import get_codec
from ..core.config import SiteConfig
from ..core.errors import BadSignature, CodecError
from ..core.kafka import TopicPartition, kafka_errors, make_consumer, read_to_end
from ..core.receivertotals import PartitionTotals
from ..core.signing import Headers, Verifier

#: How long reading one inbound partition's acks on assignment may take before it is tried again.
ACKS_READ_DEADLINE_S = 30.0
#: How many of an inbound partition's last acks a new owner keeps to find the newest figures that verify.
ACKS_WITH_FIGURES_KEPT = 16


def read_own_acks(cfg: SiteConfig, acks_topic: str, partitions: list[TopicPartition], own_acks: Verifier | None,
                  ) -> tuple[dict[str, int], dict[int, PartitionTotals], int]:
    """The highest batch id applied per sender partition (``<dsid>/<sender id>/<queue partition>``), from
    the acks this site wrote to ``partitions`` of its acks topic; the figures the newest of them that
    verifies carries, per partition; and how many records were left out, not signed with this site's key
    (``own_acks``; None: the site does not sign, and every ack counts)."""
    codec = get_codec()
    reader = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 10})
    unverified = 0
    acked: dict[str, int] = {}
    carried: dict[int, PartitionTotals] = {}
    try:
        with kafka_errors(f"reading {acks_topic}"):
            for tp in partitions:
                # The headers of the partition's last few acks: the newest figures among them that verify
                # count, so not every ack's figures are decoded and verified.
                latest: collections.deque[Headers] = collections.deque(maxlen=ACKS_WITH_FIGURES_KEPT)
                for msg in read_to_end(reader, acks_topic, tp.partition, deadline_s=ACKS_READ_DEADLINE_S):
                    if own_acks is not None:
                        try:
                            own_acks.signer(msg.value(), msg.headers())
                        except BadSignature:
                            unverified += 1
                            continue
                    latest.append(msg.headers())
                    try:
                        ack = codec.decode_as("GatewayAck", msg.value())
                    except CodecError:
                        continue
                    if ack["receiver_dsid"] != cfg.dsid:
                        continue
                    # The key from the signed record, not the record key, which nobody signed.
                    key = f"{ack['source_dsid']}/{ack['sender_id']}/{ack['queue_partition']}"
                    acked[key] = max(acked.get(key, -1), ack["batch_id"])
                found = [figures_of.from_ack(headers, cfg.dsid, own_acks) for headers in latest]
                best = figures_of.newest(f for f in found if f is not None and f.partition == tp.partition)
                if best is not None:
                    carried[tp.partition] = best
    finally:
        reader.close()
    return acked, carried, unverified


def read_published_figures(cfg: SiteConfig, own_acks: Verifier | None) -> dict[int, PartitionTotals]:
    """The inbound partitions' figures in the status topic (written there after a batch refused
    without an ack, and every few seconds), signed with this site's key when it signs."""
    reader = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 10})
    try:
        with kafka_errors(f"reading {cfg.topics.status()}"):
            return figures_of.read_status_totals(cfg, reader, own_acks)
    finally:
        reader.close()
