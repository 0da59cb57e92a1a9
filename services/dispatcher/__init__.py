"""The async-event-queue dispatcher: batches from a queue to a listener."""

from ..core.asyncevent import Accepted, AsyncEvent, AsyncEventListener, DeadLetter

__all__ = ["Accepted", "AsyncEvent", "AsyncEventListener", "DeadLetter"]
