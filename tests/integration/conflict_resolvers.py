"""A WAN conflict resolver for tests: the same answer whatever the arrival order.

Values with ``tags`` merge (the union, sorted); others keep the higher ``n``
(ties: the higher dsid).
"""

from __future__ import annotations

from sluice.region.conflicts import ConflictHelper, TimestampedEntryEvent


class MaxOrMerge:
    def on_event(self, event: TimestampedEntryEvent, helper: ConflictHelper) -> None:
        new, old = event.new_value, event.old_value
        if not isinstance(new, dict) or not isinstance(old, dict):
            return  # a destroy on either side: the event applies
        if "tags" in new and "tags" in old:
            helper.change_event_value({"tags": sorted(set(new["tags"]) | set(old["tags"]))})
        elif (new["n"], event.new_distributed_system_id) < (old["n"], event.old_distributed_system_id):
            helper.disallow_event()
