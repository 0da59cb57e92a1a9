"""Batch signatures: a receiver applies a batch only when its sending site's key signed it.

Each site has a secret key (``gateway_signing_key``); its senders sign every
``GatewayBatch`` with HMAC-SHA256 over the batch's Avro encoding with the
``signature`` field null, and put the digest in ``signature``.  A receiver
holds the key of each site it accepts (``receiver.sender_keys``, by dsid),
recomputes the digest and compares in constant time.  The source and target
dsids, the batch id and every event are covered, so a batch cannot be
redirected, renumbered or altered on the way; a replayed batch is a
duplicate batch id, acknowledged again and not applied.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from .codec import Codec


def _digest(codec: Codec, key: bytes, batch: dict[str, Any]) -> bytes:
    unsigned = dict(batch, signature=None)
    return hmac.new(key, codec.encode("GatewayBatch", unsigned, validate=False), hashlib.sha256).digest()


def sign(codec: Codec, key: bytes, batch: dict[str, Any]) -> bytes:
    """The signature of a GatewayBatch record (its ``signature`` field is ignored)."""
    return _digest(codec, key, batch)


def verify(codec: Codec, key: bytes, batch: dict[str, Any]) -> bool:
    """Whether the batch's ``signature`` is the one ``key`` makes."""
    signature = batch.get("signature")
    if not signature:
        return False
    return hmac.compare_digest(signature, _digest(codec, key, batch))


__all__ = ["sign", "verify"]
