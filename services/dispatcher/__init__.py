"""The async-event-queue dispatcher: batches from a queue to a listener."""

from ..core.asyncevent import AsyncEvent, AsyncEventListener

__all__ = ["AsyncEvent", "AsyncEventListener"]
