"""Gateway signatures (core/signing.py): Ed25519 over the record bytes, verified with the signer's public key.

Each test opens with what it proves.  No broker: the records are encoded here,
the headers are what a producer would write beside them.
"""

from __future__ import annotations

import pytest

from sluice.core import sitekeys
from sluice.core.codec import get_codec
from sluice.core.errors import BadSignature
from sluice.core.signing import SIGNATURE_HEADER, SIGNER_HEADER, Signer, Verifier, sign, verify

A_PRIVATE, A_PUBLIC = sitekeys.generate()
B_PRIVATE, B_PUBLIC = sitekeys.generate()


def _key(text: str) -> object:
    return sitekeys.load_private_key(text)


def _batch_bytes(source: int = 1, value: bytes = b'{"n": 1}') -> bytes:
    event = {"region": "orders", "key": "k1", "operation": "CREATE", "value": value, "value_encoding": "json",
             "callback_argument": None, "possible_duplicate": False,
             "event_id": {"member_id": "m", "thread_id": 1, "sequence_id": 1},
             "version": {"dsid": source, "timestamp": 1, "entry_version": 1, "member_id": "m"},
             "origin_dsid": source, "visited_dsids": [], "bucket": 0, "event_time": 1, "transaction": None}
    record = {"sender_id": "to-c", "source_dsid": source, "target_dsid": 3, "queue_partition": 0, "batch_id": 7,
              "first_offset": 0, "last_offset": 0, "possible_duplicate": False, "created_at": 1, "events": [event],
              "signature": None}
    return get_codec().encode("GatewayBatch", record)


def _verifier() -> Verifier:
    return Verifier({1: sitekeys.load_public_keys(A_PUBLIC), 2: sitekeys.load_public_keys(B_PUBLIC)})


def test_bytes_signed_with_a_key_verify_with_its_public_key_only() -> None:
    """sign/verify over bytes: the signer's public key verifies them, another site's key does not."""
    data = _batch_bytes()
    signature = sign(_key(A_PRIVATE), data)
    assert len(signature) == 64
    assert verify(sitekeys.load_public_keys(A_PUBLIC), data, signature)
    assert not verify(sitekeys.load_public_keys(B_PUBLIC), data, signature)


@pytest.mark.parametrize("change", ["flipped byte", "truncated", "appended", "empty"])
def test_bytes_changed_after_signing_do_not_verify(change: str) -> None:
    """One flipped bit anywhere, a truncated or extended record, or nothing at all: refused."""
    data = _batch_bytes()
    signature = sign(_key(A_PRIVATE), data)
    altered = {"flipped byte": data[:30] + bytes([data[30] ^ 1]) + data[31:], "truncated": data[:-1],
               "appended": data + b"\x00", "empty": b""}[change]
    assert not verify(sitekeys.load_public_keys(A_PUBLIC), altered, signature)


def test_a_truncated_or_malformed_signature_is_refused_not_raised() -> None:
    """A signature of the wrong length, or all zeros, is a refusal (False), never an exception."""
    data = _batch_bytes()
    signature = sign(_key(A_PRIVATE), data)
    keys = sitekeys.load_public_keys(A_PUBLIC)
    assert not verify(keys, data, signature[:63])
    assert not verify(keys, data, b"")
    assert not verify(keys, data, bytes(64))


def test_the_verifier_names_the_signer_from_the_headers() -> None:
    """A record signed by site 1 (headers as the Signer writes them) verifies as dsid 1."""
    data = _batch_bytes()
    headers = Signer(1, _key(A_PRIVATE)).headers(data)
    assert dict(headers)[SIGNER_HEADER] == b"1"
    assert _verifier().signer(data, headers) == 1
    # Other headers beside them (trace context) change nothing.
    assert _verifier().signer(data, [("traceparent", b"00-x"), *headers]) == 1


def test_a_site_cannot_sign_as_another_with_its_own_key() -> None:
    """B holds only A's public key: a record B signs but labels as A's (signer header 1) is refused; labelled
    as its own (signer 2) it verifies as dsid 2, so the receiver can see it is not from dsid 1."""
    data = _batch_bytes(source=1)
    forged = [(SIGNER_HEADER, b"1"), (SIGNATURE_HEADER, sign(_key(B_PRIVATE), data))]
    with pytest.raises(BadSignature) as refused:
        _verifier().signer(data, forged)
    assert refused.value.field == SIGNATURE_HEADER and "dsid 1" in refused.value.reason
    assert _verifier().signer(data, Signer(2, _key(B_PRIVATE)).headers(data)) == 2


@pytest.mark.parametrize(("headers", "field", "reason"), [
    (None, SIGNER_HEADER, "not signed"),
    ([(SIGNER_HEADER, b"1")], SIGNATURE_HEADER, "not signed"),
    ([(SIGNER_HEADER, b"one"), (SIGNATURE_HEADER, bytes(64))], SIGNER_HEADER, "dsid from 1 to 255"),
    ([(SIGNER_HEADER, b"9"), (SIGNATURE_HEADER, bytes(64))], SIGNER_HEADER, "no public key of dsid 9"),
    ([(SIGNER_HEADER, b"1"), (SIGNER_HEADER, b"2"), (SIGNATURE_HEADER, bytes(64))], SIGNER_HEADER, "once"),
])
def test_records_without_a_usable_signature_are_refused_with_field_value_and_reason(
        headers: list[tuple[str, bytes]] | None, field: str, reason: str) -> None:
    """Unsigned, half-signed, an unknown or garbled signer, or two signer headers: BadSignature naming the
    header at fault and why."""
    with pytest.raises(BadSignature) as refused:
        _verifier().signer(_batch_bytes(), headers)
    assert refused.value.field == field and reason in refused.value.reason


def test_a_record_written_with_an_older_schema_verifies_over_its_own_bytes() -> None:
    """The signature covers the bytes as written, whatever schema version wrote them: nothing is
    re-encoded to verify, so a GatewayBatch v1 record verifies."""
    import io
    import json

    import fastavro
    from fastavro.schema import fingerprint, to_parsing_canonical_form

    from sluice.core.codec import MARKER, schema_dir

    old = fastavro.parse_schema(json.loads((schema_dir() / "history" / "GatewayBatch.v1.avsc").read_text()),
                                named_schemas={})
    record = get_codec().decode_as("GatewayBatch", _batch_bytes())
    for event in record["events"]:
        event.pop("transaction")  # v1 has no transaction mark
    buf = io.BytesIO()
    buf.write(MARKER + bytes.fromhex(fingerprint(to_parsing_canonical_form(old), "CRC-64-AVRO")))
    fastavro.schemaless_writer(buf, old, record)
    data = buf.getvalue()
    assert data != _batch_bytes()
    assert _verifier().signer(data, Signer(1, _key(A_PRIVATE)).headers(data)) == 1
    assert get_codec().decode_as("GatewayBatch", data)["batch_id"] == 7


def test_during_a_rotation_either_public_key_of_a_site_verifies() -> None:
    """A site's public key text may hold its old and new keys (a rotation): what either private key signed
    verifies, a third key's signature does not; each key is checked when the text is loaded."""
    new_private, new_public = sitekeys.generate()
    keys = sitekeys.load_public_keys(f"{A_PUBLIC}\n{new_public}\n")
    assert [sitekeys.public_text(k) for k in keys] == [A_PUBLIC, new_public]
    assert [sitekeys.public_text(k) for k in sitekeys.load_public_keys(f"{A_PUBLIC}, {new_public}")] == \
        [A_PUBLIC, new_public]
    data = _batch_bytes()
    verifier = Verifier({1: keys})
    for private in (A_PRIVATE, new_private):
        assert verifier.signer(data, Signer(1, _key(private)).headers(data)) == 1
    with pytest.raises(BadSignature):
        verifier.signer(data, Signer(1, _key(B_PRIVATE)).headers(data))
    with pytest.raises(sitekeys.KeyFormatError):
        sitekeys.load_public_keys(f"{A_PUBLIC}\nnot-a-key")
    # load_public_key (what the site file check calls) takes such a text too, checking every key.
    assert sitekeys.public_text(sitekeys.load_public_key(f"{A_PUBLIC}\n{new_public}")) == A_PUBLIC


def test_pem_public_keys_one_after_another_are_a_rotation_too() -> None:
    """Two SubjectPublicKeyInfo PEM blocks in one text are two keys; text outside the blocks is refused."""
    from cryptography.hazmat.primitives import serialization

    def pem(text: str) -> str:
        return sitekeys.load_public_key(text).public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()

    keys = sitekeys.load_public_keys(pem(A_PUBLIC) + pem(B_PUBLIC))
    assert [sitekeys.public_text(k) for k in keys] == [A_PUBLIC, B_PUBLIC]
    with pytest.raises(sitekeys.KeyFormatError, match="outside the PEM blocks"):
        sitekeys.load_public_keys(pem(A_PUBLIC) + "junk")


def test_a_batch_of_queued_event_bodies_is_signed_over_its_bytes_and_any_changed_byte_refused() -> None:
    """A GatewayBatch v3 (event bodies as queued, the sender's changes beside them) verifies as written; a
    changed byte in an event body, in the duplicate indexes or in the visited sites the sender adds does not:
    what the owner merges in is covered by the signature like the events."""
    from sluice.core.eventwire import entry_event_body, gateway_batch
    from sluice.core.events import EntryEvent, EventID, Operation, VersionTag

    event = EntryEvent("orders", "k1", Operation.CREATE, b'{"n": 1}', EventID("m", 1, 1), VersionTag(1, 1, 1, "m"), 1,
                       0, 1)
    data = gateway_batch(get_codec().header("GatewayBatch"), sender_id="to-c", source_dsid=1, target_dsid=3,
                         queue_partition=0, batch_id=7, first_offset=0, last_offset=0, possible_duplicate=False,
                         created_at=1, bodies=[entry_event_body(event)], duplicate_events=[0],
                         visited_added={"orders": [1, 3]})
    headers = Signer(1, _key(A_PRIVATE)).headers(data)
    assert _verifier().signer(data, headers) == 1
    body_at = data.index(b'{"n": 1}')
    tail = len(data) - 6  # inside duplicate_events / visited_added, before the last arrays end
    for at in (body_at, tail):
        altered = data[:at] + bytes([data[at] ^ 2]) + data[at + 1:]
        with pytest.raises(BadSignature):
            _verifier().signer(altered, headers)
