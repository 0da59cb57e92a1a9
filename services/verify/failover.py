"""Failover time, read from the services' logs: from the kill -9 of a primary to its successor's first work.

What a victim held when it died, and when a successor first worked on each
of those parts, per kind of service (each incarnation logs to a file of its
own, see ``sites.Service``):

=============  =========================================  ===============================================
kind           held (last assignment before the kill)     resumed (first line after the kill, any other log)
=============  =========================================  ===============================================
sender,        ``queue Q: primary for partitions [..]``   ``queue Q[p]: first batch dispatched since
dispatcher     (less ``revoked`` / ``lost`` partitions)   taking the partition``
receiver       ``receiver M: inbound partitions [..]``    ``first batch handled on inbound partition p``
region         ``assigned orders[0], …`` (less revoked)   ``loaded orders[0]: …``
subscriptions  ``primary for registry partitions [..]``   the same line in a successor's log
=============  =========================================  ===============================================

The failover of one kill is the time until *every* part the victim held has
resumed somewhere: the gap an operator sees on the worst of its partitions.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
_LIST = re.compile(r"\[([\d, ]*)\]")
_BUCKET = re.compile(r"(\w[\w.-]*)\[(\d+)\]")


@dataclass(frozen=True, slots=True)
class Failover:
    """One kill -9 of a primary and how long its work waited."""

    kind: str
    victim: str
    killed_at: float  # wall clock
    held: tuple[str, ...]  # the parts it held: partitions or region buckets
    seconds: float | None  # None: some part it held never resumed in the logs read

    def describe(self) -> str:
        parts = ", ".join(self.held) or "nothing"
        when = "not resumed" if self.seconds is None else f"{self.seconds:.1f}s"
        return f"{self.victim}: held {parts}; resumed after {when}"


def log_lines(path: Path) -> Iterator[tuple[float, str]]:
    """(wall-clock time, message) of each log record of a service log ("TIME LEVEL LOGGER message")."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return
    for line in text.splitlines():
        m = _STAMP.match(line)
        if m is None:
            continue
        stamp = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
        rest = line[m.end():].split(" ", 2)
        yield stamp, rest[2] if len(rest) == 3 else ""


def _numbers(text: str) -> set[str]:
    m = _LIST.search(text)
    return {n.strip() for n in m.group(1).split(",") if n.strip()} if m else set()


def _buckets(text: str) -> set[str]:
    return {f"{r}[{b}]" for r, b in _BUCKET.findall(text)}


def held(kind: str, log: Path, until: float) -> set[str]:
    """What the victim held at ``until`` (the moment of the kill), by its own log."""
    parts: set[str] = set()
    for stamp, msg in log_lines(log):
        if stamp > until:
            break
        if kind in ("sender", "dispatcher"):
            if ": primary for partitions [" in msg:
                parts = _numbers(msg)
            elif ": revoked partitions [" in msg or ": lost partitions [" in msg:
                parts -= _numbers(msg)
        elif kind == "receiver":
            if ": inbound partitions [" in msg:
                parts = _numbers(msg)
        elif kind == "region":
            if msg.startswith("assigned "):
                parts = _buckets(msg)
            elif msg.startswith("revoked "):
                parts -= _buckets(msg)
        elif kind == "subscriptions":
            if ": primary for registry partitions [" in msg:
                parts |= _numbers(msg)
            elif ": no longer primary for registry partitions [" in msg:
                parts -= _numbers(msg)
    return parts


def resumed(kind: str, logs: list[Path], after: float) -> dict[str, float]:
    """Part → the first time, after ``after``, a successor's log shows it working on it."""
    first: dict[str, float] = {}
    for log in logs:
        for stamp, msg in log_lines(log):
            if stamp < after:
                continue
            found: set[str] = set()
            if kind in ("sender", "dispatcher"):
                m = re.search(r"\[(\d+)\]: first batch dispatched since taking the partition", msg)
                found = {m.group(1)} if m else set()
            elif kind == "receiver":
                m = re.search(r"first batch handled on inbound partition (\d+)", msg)
                found = {m.group(1)} if m else set()
            elif kind == "region":
                m = re.match(r"loaded (\w[\w.-]*)\[(\d+)\]", msg)
                found = {f"{m.group(1)}[{m.group(2)}]"} if m else set()
            elif kind == "subscriptions" and ": primary for registry partitions [" in msg:
                found = _numbers(msg)
            for part in found:
                if part not in first or stamp < first[part]:
                    first[part] = stamp
    return first


def measure(kind: str, victim: str, victim_log: Path, successor_logs: list[Path], killed_at: float) -> Failover:
    """The failover of one kill: until every part the victim held resumed in a successor's log."""
    parts = held(kind, victim_log, killed_at)
    first = resumed(kind, successor_logs, killed_at)
    waits = [first.get(p) for p in parts]
    seconds = None if any(w is None for w in waits) else max((w - killed_at for w in waits if w), default=0.0)
    return Failover(kind, victim, killed_at, tuple(sorted(parts, key=_order)), seconds)


def _order(part: str) -> tuple[str, int]:
    m = _BUCKET.fullmatch(part)
    return (m.group(1), int(m.group(2))) if m else ("", int(part))


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]
