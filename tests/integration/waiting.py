"""Waiting in integration tests: on a condition, with a named deadline, never a fixed sleep.

``wait_for(condition, timeout_s=..., what=...)`` polls ``condition`` until it returns a truthy value and
returns that value; past the deadline it fails the test, naming what it waited for.  A test that must show
that something does NOT happen (nothing more arrives, no alert is raised) says so with ``holds_for``:
``condition`` must stay true for the whole window, which is the property, not a pause.

Every deadline is a named constant of the test that uses it (how long the thing may take on a busy 2-core
machine), so a failure reads "not within 60 s: b owns bucket 3", never a bare timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: How often a condition is evaluated again.  Small next to every deadline, large enough not to load the
#: machine: most conditions are an HTTP call or a file read.
POLL_S = 0.1


class NotWithin(AssertionError):
    """A condition was not met within its deadline (the message names it and the last value seen)."""


def wait_for(condition: Callable[[], T], *, timeout_s: float, what: str, poll_s: float = POLL_S) -> T:
    """Return the first truthy value of ``condition()``; fail naming ``what`` when ``timeout_s`` passes first.

    ``condition`` is evaluated at least once, and once more at the deadline, so a slow condition still gets
    its last chance.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        now = time.monotonic()
        if now >= deadline:
            raise NotWithin(f"not within {timeout_s} s: {what} (last: {value!r})")
        time.sleep(min(poll_s, deadline - now))


def holds_for(condition: Callable[[], object], *, window_s: float, what: str, poll_s: float = POLL_S) -> None:
    """Fail as soon as ``condition()`` is falsy within the next ``window_s`` seconds (naming ``what``).

    For properties of the form "nothing more arrives" or "no alert is raised": the window is how long the
    thing would take to show up if it were going to.
    """
    deadline = time.monotonic() + window_s
    while True:
        value = condition()
        if not value:
            raise AssertionError(f"no longer true after {window_s - (deadline - time.monotonic()):.1f} s of "
                                 f"{window_s} s: {what} (last: {value!r})")
        now = time.monotonic()
        if now >= deadline:
            return
        time.sleep(min(poll_s, deadline - now))


def read_until(read: Callable[[], T], until: Callable[[T], object], *, timeout_s: float,
               poll_s: float = POLL_S) -> T:
    """Call ``read()`` until ``until(value)`` is true or ``timeout_s`` passes; return the last value read.

    Does not fail by itself: the caller asserts on the value it returns, with the details only it can give
    ("3 keys differ on B, e.g. ...").  ``read`` is called at least once, and once more at the deadline.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        now = time.monotonic()
        if until(value) or now >= deadline:
            return value
        time.sleep(min(poll_s, deadline - now))


def settles(read: Callable[[], T], *, quiet_s: float, timeout_s: float, what: str, poll_s: float = POLL_S) -> T:
    """Call ``read()`` until its value has not changed for ``quiet_s``; return that value.

    For "and then nothing more arrives": the value (offsets, counts) must stay put for ``quiet_s``, the
    time anything still on its way would take to show up.  Fails, naming ``what``, when it is still
    changing after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    value = read()
    quiet_since = time.monotonic()
    while True:
        now = time.monotonic()
        if now - quiet_since >= quiet_s:
            return value
        if now >= deadline:
            raise NotWithin(f"still changing after {timeout_s} s: {what} (last: {value!r})")
        time.sleep(max(0.01, min(poll_s, quiet_s - (now - quiet_since))))
        again = read()
        if again != value:
            value, quiet_since = again, time.monotonic()
