"""The receivers' figures per inbound partition (services/receiver/totals.py) and how a batch's repeats are
counted (``Applied``, receiver/protocol.py): what a new owner continues from, what an ack carries, what is recovered."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sluice.admin.statusdoc import document, empty_snapshot
from sluice.core.regionclient import BatchAnswer
from sluice.core.codec import schema_dir
from sluice.core.config import SiteConfig
from sluice.core.signing import Signer, Verifier
from sluice.receiver.protocol import Applied
from sluice.core.receivertotals import (COUNTS, PartitionTotals, ack_headers, from_ack, from_status, newest, status_key,
                                    summed)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "status-json.md"


def _answer(count: int, applied: int, duplicates: int, refused: list[int] = ()) -> BatchAnswer:
    return BatchAnswer(count, applied, duplicates, 0, [{"index": i, "retriable": True} for i in refused], None)


def test_the_counts_are_the_schemas() -> None:
    """COUNTS names the ReceiverCounts fields, in order: a figure added to one is added to the other."""
    schema = json.loads((schema_dir() / "ReceiverPartitionTotals.avsc").read_text())
    carried = next(f for f in schema["fields"] if f["name"] == "carried")
    assert tuple(f["name"] for f in carried["type"]["fields"]) == COUNTS


def test_a_new_owner_continues_from_the_newest_figures_and_says_whose_they_were() -> None:
    """The figures covering the highest offset win; the new owner carries them and names their writer;
    what it counts itself is totals minus carried, and a batch it reads again is not counted twice."""
    older = PartitionTotals(3, 2, offset=10, member="r1", totals={**dict.fromkeys(COUNTS, 0), "batches": 5},
                            updated_at=100)
    newer = PartitionTotals(3, 2, offset=12, member="r1", totals={**dict.fromkeys(COUNTS, 0), "batches": 6},
                            updated_at=90)
    assert newest([None, older, newer]) is newer and newest([None]) is None
    mine = newer.taken_over_by("r2", 200)
    assert (mine.member, mine.carried_from, mine.carried["batches"], mine.offset) == ("r2", "r1", 6, 12)
    counted = mine.counting(13, 201, batches=1, events_applied=40, events_recovered=4)
    assert counted.totals["batches"] == 7 and counted.own == {**dict.fromkeys(COUNTS, 0), "batches": 1,
                                                              "events_applied": 40, "events_recovered": 4}
    with pytest.raises(AssertionError):
        counted.counting(13, 202, batches=1)
    with pytest.raises(AssertionError):
        counted.counting(14, 202, bogus=1)
    assert summed([counted, older])["batches"] == 12


def test_figures_travel_signed_in_an_ack_and_are_refused_forged_or_of_another_site() -> None:
    """An ack's figures verify with the site's key; a forged signature, another site's figures or figures
    without a signature at a signing site are not taken.  The status record is verified the same way."""
    key = Ed25519PrivateKey.generate()
    signer = Signer(2, key)
    verifier = Verifier({2: [signer.public_key]})
    figures = PartitionTotals(1, 2, offset=7, member="r1", totals={**dict.fromkeys(COUNTS, 0), "batches": 3})
    data = figures.encode()
    headers = ack_headers(signer.headers(b"the ack"), data, signer)
    assert from_ack(headers, 2, verifier) == figures
    assert from_ack(headers, 3, None) is None, "figures of another site"
    forged = [(k, v if k != "sluice-receiver-totals-signature" else bytes(64)) for k, v in headers]
    assert from_ack(forged, 2, verifier) is None
    assert from_ack(ack_headers(None, data, None), 2, verifier) is None, "unsigned at a signing site"
    assert from_ack(ack_headers(None, data, None), 2, None) == figures, "a site that signs nothing"
    assert from_ack(signer.headers(b"an ack of an older release"), 2, verifier) is None
    assert from_status(data, signer.headers(data), 2, verifier) == figures
    assert from_status(data, signer.headers(b"something else"), 2, verifier) is None
    assert status_key(1) == b"receiver-partition/1"


def test_repeats_are_recovered_only_in_requests_of_events_an_attempt_may_have_applied_unanswered() -> None:
    """After a takeover (every event unanswered) or a request that got no answer, the retry's repeats were
    applied by the attempt that left no answer: counted applied (recovered).  A request of events already
    answered counts its repeats as repeats; events refused for now stay unanswered."""
    applied = Applied(unanswered=set(range(4)))
    applied.took([0, 1, 2, 3], _answer(4, 1, 2, refused=[3]))
    assert (applied.applied, applied.recovered, applied.duplicates, applied.unanswered) == (1, 2, 0, {3})
    applied.took([3], _answer(1, 0, 1))
    assert (applied.recovered, applied.duplicates, applied.unanswered) == (3, 0, set())

    fresh = Applied()
    fresh.took([0, 1], _answer(2, 1, 1))
    assert (fresh.applied, fresh.recovered, fresh.duplicates) == (1, 0, 1)
    fresh.unanswered.update([2, 3])  # their request got no answer
    fresh.took([2, 3], _answer(2, 0, 2))
    assert (fresh.recovered, fresh.duplicates) == (2, 1)


def test_the_document_fields_are_the_ones_docs_status_json_lists() -> None:
    """docs/status-json.md's "Top level" table names exactly the document's fields, and the data sections of
    an empty sample are among them."""
    text = DOCS.read_text()
    section = text.split("## Top level", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", section, re.MULTILINE))
    cfg = SiteConfig.model_validate({"site": "a", "dsid": 1, "kafka": {"bootstrap_servers": "127.0.0.1:9092"},
                                     "regions": [{"name": "orders"}]})
    built = document(cfg, empty_snapshot())
    assert set(built) == documented
    assert built["version"] == 1 and set(empty_snapshot()) <= documented

