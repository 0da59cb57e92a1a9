"""Gateway event filters and a substitution filter for tests.

``KeepLocalOut``: before_enqueue keeps keys starting ``local-`` out of the
queue.  ``HoldSecrets``: before_transmit does not send keys starting
``secret-``.  ``RecordAcks``: after_acknowledgement appends the key and
EventID of each acknowledged event to the file named by the environment
variable ``SLUICE_TEST_ACKS``.  ``Redact``: replaces a JSON value's
``card`` field with ``"****"``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from sluice.core.asyncevent import AsyncEvent


class KeepLocalOut:
    def before_enqueue(self, event: AsyncEvent) -> bool:
        return not event.key.startswith("local-")


class HoldSecrets:
    def before_transmit(self, event: AsyncEvent) -> bool:
        return not event.key.startswith("secret-")


class RecordAcks:
    def after_acknowledgement(self, event: AsyncEvent) -> None:
        with open(os.environ["SLUICE_TEST_ACKS"], "a", encoding="utf-8") as f:
            f.write(json.dumps([event.key, str(event.event_id)]) + "\n")


class Redact:
    def get_substitute_value(self, event: AsyncEvent) -> Any:
        value = event.value
        if isinstance(value, dict) and "card" in value:
            return {**value, "card": "****"}
        return None
