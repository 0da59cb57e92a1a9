"""The lifecycle every long-running service goes through, owned once by ``Service``::

    NEW ──start()──► RUNNING ──stop()──► STOPPING ──► STOPPED
     │                  │                   │
     │                  └── a thread died ──┴──► CRASHED (exit non-zero)
     ├── stop() before start() ──► STOPPED (nothing was opened)
     └── start() raised ──► CRASHED

The story, step by step:

1. ``start()`` opens the service's clients and ends with ``_set_running()``
   (NEW → RUNNING).  A service is started once: ``start()`` on any other state
   raises ``IllegalTransition``, so a stopped service is never restarted (the
   CLI builds a new one).
2. ``run()`` is the owner's loop.  It runs inside ``crash_guard()``: an
   exception that leaves it is recorded (``crash``), the state goes CRASHED,
   and the exception goes on up, so the process exits non-zero and Kubernetes
   restarts it.  A ``Stopping`` (core/errors.py) that leaves it is a stop, not a
   crash.  Its ``finally`` releases what it owns and calls ``_set_stopped()``,
   which keeps CRASHED.
3. A worker thread is started by ``spawn()``: its crash is recorded the same
   way (the first crash wins), the stop flag is set so every wait of the
   service ends, and the owner's loop raises it at its next turn
   (``raise_crash()``), as aiokafka's sender fails every pending batch when its
   task dies: nothing is logged and forgotten.
4. ``stop()`` is idempotent and may be called from any thread (a signal
   handler, the HTTP face, a test): the first call moves RUNNING → STOPPING,
   sets ``stopping`` and calls ``on_stop()`` (also on a crashed service, which
   still has clients to release); every later call waits for that to end and
   does nothing more.

Every move goes through one table (``TRANSITIONS``) under one lock: a move the
table does not hold is our own bug and raises ``IllegalTransition`` rather than
leaving a state nobody drew.  ``/healthz`` reads ``state`` and ``crash``
(core/health.py).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from typing import Callable, Iterator

from .errors import IllegalTransition, Stopping

log = logging.getLogger("sluice.lifecycle")


class ServiceState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    CRASHED = "crashed"


#: Every move a service may make; anything else raises ``IllegalTransition``.
TRANSITIONS: dict[ServiceState, frozenset[ServiceState]] = {
    ServiceState.NEW: frozenset({ServiceState.RUNNING, ServiceState.STOPPED, ServiceState.CRASHED}),
    ServiceState.RUNNING: frozenset({ServiceState.STOPPING, ServiceState.CRASHED}),
    ServiceState.STOPPING: frozenset({ServiceState.STOPPED, ServiceState.CRASHED}),
    ServiceState.STOPPED: frozenset(),
    ServiceState.CRASHED: frozenset(),
}

#: States a service never leaves.
FINAL = (ServiceState.STOPPED, ServiceState.CRASHED)


class Service:
    """The lifecycle of one service: its state, its crash, its stop flag.

    Subclasses call ``super().__init__()``, end ``start()`` with ``_set_running()``, run their loop
    inside ``crash_guard()`` and end it with ``_set_stopped()``, start their worker threads with
    ``spawn()``, and put what a stop must also do (wake a lane, close a socket) in ``on_stop()``.
    """

    #: What the service is, in its messages ("receiver", "gateway-sender"...).
    kind = "service"

    def __init__(self) -> None:
        self._state = ServiceState.NEW
        #: Why the service crashed (the first crash of any of its threads); None while it has not.
        self.crash: BaseException | None = None
        #: Set by ``stop()`` and by a crash: every wait of the service ends on it.
        self._stopping = threading.Event()
        self._lifecycle_lock = threading.Lock()
        #: Held while the first ``stop()`` runs ``on_stop()``: a second caller waits for it to end.
        self._stop_lock = threading.RLock()
        self._stop_requested = False

    @property
    def state(self) -> ServiceState:
        return self._state

    @property
    def stopping(self) -> threading.Event:
        return self._stopping

    # --- transitions -------------------------------------------------------------------

    def _move(self, to: ServiceState) -> None:
        """Under the lifecycle lock: the one place the state changes."""
        if to not in TRANSITIONS[self._state]:
            raise IllegalTransition(f"{self.kind} {self._describe()}", self._state.value, to.value)
        log.debug("%s %s: %s → %s", self.kind, self._describe(), self._state.value, to.value)
        self._state = to

    def _describe(self) -> str:
        return str(getattr(self, "member_id", None) or getattr(self, "instance_id", None) or hex(id(self)))

    def _check_startable(self) -> None:
        """The beginning of ``start()``, before it opens anything: ``IllegalTransition`` unless NEW."""
        with self._lifecycle_lock:
            if self._state is not ServiceState.NEW:
                raise IllegalTransition(f"{self.kind} {self._describe()}", self._state.value,
                                        ServiceState.RUNNING.value)

    def _set_running(self) -> None:
        """The end of ``start()``: NEW → RUNNING.  Raises ``IllegalTransition`` on a service started
        before, stopped or crashed."""
        with self._lifecycle_lock:
            self._move(ServiceState.RUNNING)

    def _set_stopped(self) -> None:
        """The end of the owner's loop: STOPPING (or RUNNING, a loop that ended by itself) → STOPPED.
        A crashed or stopped service stays as it is."""
        with self._lifecycle_lock:
            if self._state is ServiceState.RUNNING:
                self._move(ServiceState.STOPPING)
            if self._state not in FINAL:
                self._move(ServiceState.STOPPED)
        self._stopping.set()

    def record_crash(self, exc: BaseException) -> bool:
        """A thread of the service died of ``exc``: the first crash is kept, the state goes CRASHED and
        every wait ends.  False when the service had stopped or crashed already (this one is only
        logged)."""
        with self._lifecycle_lock:
            if self._state in FINAL:
                if exc is not self.crash:
                    log.warning("%s %s: %r after it was %s", self.kind, self._describe(), exc, self._state.value)
                return False
            self.crash = exc
            self._move(ServiceState.CRASHED)
        self._stopping.set()
        return True

    def raise_crash(self) -> None:
        """Owner's loop: raise the crash a worker thread recorded, so the loop ends as crashed."""
        crash = self.crash
        if crash is not None:
            raise crash

    def stop(self) -> None:
        """Idempotent, from any thread: the first call moves a running service to STOPPING (one never
        started to STOPPED; a crashed one stays CRASHED), sets the stop flag and calls ``on_stop()``
        once; a call while that runs waits for it; later calls do nothing."""
        with self._stop_lock:
            if self._stop_requested:
                return
            self._stop_requested = True
            with self._lifecycle_lock:
                if self._state is ServiceState.NEW:
                    self._move(ServiceState.STOPPED)
                elif self._state is ServiceState.RUNNING:
                    self._move(ServiceState.STOPPING)
            self._stopping.set()
            self.on_stop()

    def on_stop(self) -> None:
        """What the first ``stop()`` does besides setting the stop flag, whatever the state (a service
        without a loop of its own releases its resources here and ends with ``_set_stopped()``)."""

    # --- crash capture -----------------------------------------------------------------

    @contextlib.contextmanager
    def crash_guard(self) -> Iterator[None]:
        """Around the top of a thread of the service: an exception that leaves the block is recorded
        (``record_crash``) and raised on; a ``Stopping`` is a stop and ends the block quietly; a
        ``KeyboardInterrupt`` is the operator's and goes on up unrecorded."""
        try:
            yield
        except Stopping:
            pass
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            self.record_crash(exc)
            raise

    def spawn(self, target: Callable[[], None], name: str) -> threading.Thread:
        """Start a worker thread whose crash is the service's (``record_crash``); its exception is
        logged with the thread's name and raised by the owner's loop (``raise_crash``)."""

        def guarded() -> None:
            try:
                with self.crash_guard():
                    target()
            except Exception:  # recorded by crash_guard: the owner raises it; here it is only logged
                log.exception("%s %s: thread %s crashed", self.kind, self._describe(), name)

        thread = threading.Thread(target=guarded, name=name, daemon=True)
        thread.start()
        return thread


__all__ = ["FINAL", "Service", "ServiceState", "TRANSITIONS"]
