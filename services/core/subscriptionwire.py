"""A client's read of its subscription messages without a full decode (issue 18).

The subscription service writes each event to a client's queue as the
changelog's EntryEvent body spliced into a ClientMessage
(``eventwire.client_event_message``): the header, the four bytes of kind
EVENT, an empty session, version 0 and the event union's branch, the body,
then ``receive_values``, ``possible_duplicate``, ``filled_at`` and an empty
``reason``.  A client reads every message of its queue, and reading one
through fastavro (``Codec.decode_as``) and then building the event from its
dictionaries cost more than everything else a client does with it.

``read_client_event`` reads such a message as the bytes it is: the body's
end is found from the message's end (the empty reason's one byte, the
``filled_at`` varint, whose bytes all but the last have the high bit set,
and the two booleans before it), the body is read by ``eventwire.decode_entry``
(the compiled reader where it is built), which takes it only when it ends
exactly there, and the fields after it are then those the forward read
finds.  So what it returns is what fastavro reads of the same bytes.  Any
message of another shape (a registration's answer, a marker, a refusal, an
older ClientMessage version, a damaged record) gives None, and the caller
reads it through the codec, which reads it or says why it cannot.
"""

from __future__ import annotations

from .errors import MalformedRecord
from .events import EntryEvent
from .eventwire import decode_entry

#: A ClientMessage's bytes between its header and its event body, for an event: kind EVENT (symbol
#: 0), session "", version 0, and the event union's branch 1 (an EntryEvent follows).
EVENT_HEAD = b"\x00\x00\x00\x02"
#: The longest ``filled_at`` read here: 9 bytes hold 63 bits, so any long of up to 9 bytes is valid.
#: A longer one (a far-off time, never written by the service) is left to the codec.
_FILLED_AT_BYTES_MAX = 9
#: The fewest bytes after the body: two booleans, a one-byte varint and the empty reason.
_TAIL_BYTES_MIN = 4


def read_client_event(header: bytes, data: bytes | None) -> tuple[EntryEvent, bool, bool] | None:
    """(event, receive_values, possible_duplicate) of a ClientMessage of kind EVENT as the service
    writes it (``header``: ``codec.header("ClientMessage")``), equal to what fastavro reads of it;
    None for any other message, which the codec reads instead (the unit tests check both)."""
    if data is None:
        return None
    head = len(header) + len(EVENT_HEAD)
    n = len(data)
    if n < head + _TAIL_BYTES_MIN or data[-1] != 0 or not data.startswith(header) \
            or data[head - len(EVENT_HEAD):head] != EVENT_HEAD:
        return None
    last = n - 2  # filled_at's last byte: its high bit clear
    if data[last] & 0x80:
        return None
    first = last
    while data[first - 1] & 0x80:
        first -= 1
    if last - first + 1 > _FILLED_AT_BYTES_MAX:
        return None
    receive_values, duplicate = data[first - 2], data[first - 1]
    body_end = first - 2
    if receive_values > 1 or duplicate > 1 or body_end <= head:
        return None
    try:
        event, _layout = decode_entry(data[head:body_end])
    except MalformedRecord:
        return None
    return event, receive_values == 1, duplicate == 1


__all__ = ["EVENT_HEAD", "read_client_event"]
