"""Sites' Ed25519 keys: what a site signs its gateway batches and acks with.

Each site holds one private key (``gateway_private_key``) and the public key
of every site it exchanges events with (``gateway_public_keys``, by dsid).
A batch signed by site A can be verified by any site holding A's public key,
and forged by none of them: a receiving site cannot sign as its sender to a
third site, which a key shared between sites (HMAC) would allow.

A key is written either as the base64 of its 32 raw bytes (a private key's
seed, or a public key), which fits on one line of a site file, or as PEM
(PKCS#8 for a private key, SubjectPublicKeyInfo for a public one), as
``openssl genpkey -algorithm ed25519`` writes it.  ``sluice keys generate``
writes a pair in the base64 form.

A site's public key text may hold several keys (base64 ones separated by
spaces, commas or new lines, or PEM blocks one after another): during a key
rotation the other sites hold the old and the new public key of a site at
once and accept what either signed, so the site can switch to its new
private key with nothing refused (``load_public_keys``).
"""

from __future__ import annotations

import base64
import binascii
import re

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import KeyFormatError

RAW_KEY_BYTES = 32


def _raw(text: str, kind: str) -> bytes | None:
    """The 32 raw bytes of a base64 key, or None when ``text`` is PEM."""
    text = text.strip()
    if text.startswith("-----BEGIN"):
        return None
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise KeyFormatError(f"not an Ed25519 {kind} key: neither base64 of {RAW_KEY_BYTES} bytes nor PEM") from None
    if len(raw) != RAW_KEY_BYTES:
        raise KeyFormatError(f"not an Ed25519 {kind} key: base64 of {len(raw)} bytes, not {RAW_KEY_BYTES}")
    return raw


def load_private_key(text: str) -> Ed25519PrivateKey:
    """A private key from its base64 seed or PKCS#8 PEM (unencrypted)."""
    raw = _raw(text, "private")
    if raw is not None:
        return Ed25519PrivateKey.from_private_bytes(raw)
    try:
        key = serialization.load_pem_private_key(text.strip().encode(), password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise KeyFormatError(f"not a readable PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFormatError(f"a PEM {type(key).__name__}, not an Ed25519 private key")
    return key


_PEM_PUBLIC = re.compile(r"-----BEGIN [A-Z ]+-----.*?-----END [A-Z ]+-----", re.DOTALL)
_SEPARATORS = re.compile(r"[\s,]+")


def _public_key_texts(text: str) -> list[str]:
    """The keys of a text holding one or several: PEM blocks, or base64 keys between spaces, commas or lines."""
    text = text.strip()
    if "-----BEGIN" in text:
        blocks = _PEM_PUBLIC.findall(text)
        if _PEM_PUBLIC.sub("", text).strip():
            raise KeyFormatError("not Ed25519 public keys: text outside the PEM blocks")
        return blocks
    return [t for t in _SEPARATORS.split(text) if t]


def load_public_keys(text: str) -> tuple[Ed25519PublicKey, ...]:
    """Every public key a text holds (one, or the old and the new during a rotation), in order."""
    texts = _public_key_texts(text)
    if not texts:
        raise KeyFormatError("not an Ed25519 public key: the text is empty")
    return tuple(_load_one_public_key(t) for t in texts)


def load_public_key(text: str) -> Ed25519PublicKey:
    """A public key from its base64 raw bytes or SubjectPublicKeyInfo PEM.  Of a text holding several
    (a rotation), every one is checked and the first is returned; ``load_public_keys`` gives them all."""
    return load_public_keys(text)[0]


def _load_one_public_key(text: str) -> Ed25519PublicKey:
    raw = _raw(text, "public")
    if raw is not None:
        return Ed25519PublicKey.from_public_bytes(raw)
    try:
        key = serialization.load_pem_public_key(text.strip().encode())
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise KeyFormatError(f"not a readable PEM public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFormatError(f"a PEM {type(key).__name__}, not an Ed25519 public key")
    return key


def public_text(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The base64 form of a public key (of a private key: its public half)."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return base64.b64encode(public.public_bytes(serialization.Encoding.Raw,
                                                serialization.PublicFormat.Raw)).decode("ascii")


def private_text(key: Ed25519PrivateKey) -> str:
    """The base64 form of a private key (its seed)."""
    raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                            serialization.NoEncryption())
    return base64.b64encode(raw).decode("ascii")


def generate() -> tuple[str, str]:
    """A new key pair: (private, public), each in the base64 form."""
    key = Ed25519PrivateKey.generate()
    return private_text(key), public_text(key)


__all__ = ["KeyFormatError", "generate", "load_private_key", "load_public_key", "load_public_keys", "private_text",
           "public_text"]
