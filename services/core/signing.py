"""Gateway signatures: Ed25519 over the bytes on the wire.

Each site signs what it writes for another site with its own private key
(``gateway_private_key``): its gateway senders every ``GatewayBatch``, its
receiver every ``GatewayAck``.  The story of one record:

1. The writer encodes the record once and signs exactly those value bytes
   (the Avro single-object encoding: marker, schema fingerprint, body).  The
   64-byte Ed25519 signature goes in the record header ``sluice-signature``,
   beside ``sluice-signer``, the signing site's dsid in decimal.  The record
   itself is unchanged (GatewayBatch's ``signature`` field is no longer
   written; it stays in the schema so that old records still read).
2. The reader takes the signer's dsid from the header, looks up that site's
   public key (``gateway_public_keys``) and verifies the signature over the
   value bytes as received, once per record and before decoding anything.
   Nothing is encoded again to verify, so a record written with an older
   schema version verifies like a current one, and sites can be upgraded one
   after the other.
3. Once the record is decoded, the reader checks that it names the signer as
   the site it comes from (a batch's ``source_dsid``, an ack's
   ``receiver_dsid``): a site can sign only records that say they are its own.

Only the holder of a site's private key can sign as that site; every site
holding its public key can verify, and none of them can forge: a receiving
site cannot sign batches as their sender to a third site.  A dsid may have several public keys at
once, the old and the new during a key rotation (``sitekeys.load_public_keys``):
a signature made with any of them is accepted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from . import sitekeys
from .errors import BadSignature

if TYPE_CHECKING:
    from .config import SiteConfig

SIGNATURE_HEADER = "sluice-signature"
SIGNER_HEADER = "sluice-signer"
SIGNATURE_BYTES = 64

Headers = Sequence[tuple[str, bytes | None]] | None


def sign(key: Ed25519PrivateKey, data: bytes) -> bytes:
    """The Ed25519 signature of ``data``."""
    return key.sign(data)


def verify(keys: Sequence[Ed25519PublicKey], data: bytes, signature: bytes) -> bool:
    """Whether one of ``keys`` made ``signature`` over exactly ``data``."""
    if len(signature) != SIGNATURE_BYTES:
        return False
    for key in keys:
        try:
            key.verify(signature, data)
        except InvalidSignature:
            continue
        return True
    return False


def _only_header(headers: Headers, name: str) -> bytes | None:
    """The value of header ``name``; a record carrying it twice is refused (which one would count?)."""
    found = [value for key, value in headers or () if key == name]
    if len(found) > 1:
        raise BadSignature(name, f"{len(found)} headers", "a signed record carries it once")
    return found[0] if found else None


class Signer:
    """Signs as one site: ``headers(value)`` are the headers to write the record with."""

    def __init__(self, dsid: int, key: Ed25519PrivateKey) -> None:
        self.dsid = dsid
        self._key = key
        self._signer_header = (SIGNER_HEADER, str(dsid).encode("ascii"))

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self._key.public_key()

    def headers(self, value: bytes) -> list[tuple[str, bytes]]:
        return [self._signer_header, (SIGNATURE_HEADER, sign(self._key, value))]


class Verifier:
    """Verifies records signed by the sites it holds public keys of."""

    def __init__(self, keys: Mapping[int, Sequence[Ed25519PublicKey]]) -> None:
        self._keys = {dsid: tuple(ks) for dsid, ks in keys.items() if ks}

    @property
    def dsids(self) -> frozenset[int]:
        return frozenset(self._keys)

    def signer(self, value: bytes | None, headers: Headers) -> int:
        """The dsid whose key signed ``value``, from the record's headers; ``BadSignature`` otherwise."""
        raw_dsid = _only_header(headers, SIGNER_HEADER)
        signature = _only_header(headers, SIGNATURE_HEADER)
        if raw_dsid is None or signature is None:
            missing = SIGNER_HEADER if raw_dsid is None else SIGNATURE_HEADER
            raise BadSignature(missing, None, "the record is not signed")
        text = raw_dsid.decode("ascii", "replace")
        if not text.isdigit() or not 1 <= int(text) <= 255:
            raise BadSignature(SIGNER_HEADER, text[:20], "not a dsid from 1 to 255")
        dsid = int(text)
        keys = self._keys.get(dsid)
        if keys is None:
            raise BadSignature(SIGNER_HEADER, dsid, f"no public key of dsid {dsid} here (gateway_public_keys): "
                                                    f"records are taken from dsid(s) {sorted(self._keys)}")
        if value is None or not verify(keys, value, signature):
            raise BadSignature(SIGNATURE_HEADER, f"{len(signature)} bytes",
                               f"does not match the record with dsid {dsid}'s public key")
        return dsid


def site_signer(cfg: SiteConfig) -> Signer | None:
    """The site's signer, from ``gateway_private_key``; None when the site signs nothing."""
    key = cfg.gateway_private_key
    return None if key is None else Signer(cfg.dsid, sitekeys.load_private_key(key.get_secret_value()))


def site_verifier(cfg: SiteConfig, dsids: Iterable[int]) -> Verifier | None:
    """A verifier of the given sites' records, from ``gateway_public_keys``; None when the site does
    not sign (it has no key at all).  A signing site has a key for every site it exchanges events
    with (the site file is refused otherwise), so every dsid asked for is there."""
    if cfg.gateway_private_key is None and not cfg.gateway_public_keys:
        return None
    keys = {dsid: sitekeys.load_public_keys(cfg.gateway_public_keys[dsid])
            for dsid in dsids if dsid in cfg.gateway_public_keys}
    return Verifier(keys)


__all__ = ["SIGNATURE_HEADER", "SIGNER_HEADER", "Signer", "Verifier", "site_signer", "site_verifier",
           "sign", "verify"]
