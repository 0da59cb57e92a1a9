"""Entry values are JSON; these read and write them exactly.

orjson is fast but reads integers beyond 64 bits as floats (silently) and
refuses to write them; the standard library keeps them exact.  Values with a
long digit run take the exact path, everything else the fast one.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

_LONG_DIGITS = re.compile(rb"\d{19,}")


def loads(data: bytes) -> Any:
    if _LONG_DIGITS.search(data):
        return json.loads(data)
    return orjson.loads(data)


def dumps(value: Any) -> bytes:
    """Compact JSON; raises ValueError/TypeError for what JSON cannot hold (NaN, objects)."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def decode(data: bytes | None, encoding: str) -> Any:
    """An entry's stored value as the application sees it: JSON parsed, raw bytes as they are."""
    if data is None:
        return None
    return loads(data) if encoding == "json" else data


def encode(value: Any, encoding: str) -> bytes:
    """The stored form of a value the application gives; TypeError for a raw value that is not bytes."""
    if encoding == "json":
        return dumps(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    raise TypeError(f"a raw-encoded value must be bytes, not {type(value).__name__}")
