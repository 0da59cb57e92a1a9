"""What a wan-copy request may ask (Geode's ``gfsh wan-copy region --batch-size``).

The region service runs copies (``sluice.region.wancopy``) and refuses a
request outside these bounds.  The commands that start copies hold the same
bounds: ``sluice admin wan-copy`` refuses a ``--batch-size`` outside them by
the option's name, and ``sluice pipeline reconcile --repair`` sends the keys
it repairs in requests of at most ``KEYS_MAX``.
"""

from __future__ import annotations

#: Geode's default batch size of ``wan-copy region``, and the most one request may carry.
BATCH_SIZE_DEFAULT = 1000
BATCH_SIZE_MAX = 10_000
#: Keys a copy of given keys may name.
KEYS_MAX = 1_000_000

__all__ = ["BATCH_SIZE_DEFAULT", "BATCH_SIZE_MAX", "KEYS_MAX"]
