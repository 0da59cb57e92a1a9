"""The hand-written EntryEvent encoder moved to ``eventwire`` (the one byte-level module); these names
are kept for the callers not moved yet."""

from .eventwire import entry_event_body, string, varint, varint32

__all__ = ["entry_event_body", "string", "varint", "varint32"]
