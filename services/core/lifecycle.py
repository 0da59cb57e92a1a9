"""The lifecycle every long-running service reports::

    NEW ──start()──► RUNNING ──stop()──► STOPPING ──► STOPPED
                        └── a thread died ──► CRASHED (exit non-zero)
"""

from __future__ import annotations

import enum


class ServiceState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    CRASHED = "crashed"


__all__ = ["ServiceState"]
