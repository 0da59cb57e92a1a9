"""``sluice admin start SENDER --clean-queues``: start a stopped gateway sender with its queue emptied.

Geode's ``start gateway-sender --clean-queues`` (``GatewaySender.startWithCleanQueue``).  What the primaries
do with the request, and why it is exact, is core/queueclean.py's story; here is the operator's side:

1. ``plan_clean`` refuses what Geode refuses (a sender that is not stopped) and what it does not offer (an
   async event queue: Geode has no clean start for one), then reads, per queue partition, the head (the
   removals record), the new head (the last stable offset now) and the events in between.
2. The operator confirms (``--yes`` for scripts; a run without a terminal and without it is refused).
3. ``set_state`` writes the start (RUNNING) with the request, in one control record.
4. ``wait_applied`` follows the audits on the status topic until every partition's primary applied the
   clean, showing how many have so far; partitions with no primary running get theirs when one starts.

``clean_history`` and ``print_cleans`` show every clean and its audits for ``sluice admin status``; the
status page shows the same rows (serve.py).
"""

from __future__ import annotations

import argparse
import getpass
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, TextIO

from rich.console import Console
from rich.table import Table

from ..core.codec import get_codec
from ..core.config import SiteConfig
from ..core.errors import CodecError, InvalidRequest, NotStopped
from ..core.kafka import TopicPartition, kafka_errors, make_consumer, read_to_end
from ..core.queueclean import CleanAudit, CleanRequest, count_events, read_audits
from ..core.statusread import SIZE_COUNT_LIMIT, kind_of, read_compacted
from .cli import control_record, set_state

#: How long ``start --clean-queues`` waits for the primaries' audits by default.
WAIT_S = 60.0


@dataclass(frozen=True)
class PartitionPlan:
    partition: int
    head: int
    cut: int
    #: The events between head and cut, counted; None past SIZE_COUNT_LIMIT offsets (``cut - head`` bounds it).
    events: int | None

    @property
    def events_text(self) -> str:
        return str(self.events) if self.events is not None else f"≤{self.cut - self.head}"


@dataclass(frozen=True)
class CleanPlan:
    queue_id: str
    kind: str
    partitions: list[PartitionPlan]
    request: CleanRequest

    @property
    def events(self) -> int:
        """Events to drop (an upper bound where a partition was not counted)."""
        return sum(p.events if p.events is not None else p.cut - p.head for p in self.partitions)

    @property
    def counted(self) -> bool:
        return all(p.events is not None for p in self.partitions)


def issuer(via: str) -> str:
    """Who asks: the tool, the user and the host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    return f"{via} ({user}@{socket.gethostname()})"


def desired_state(cfg: SiteConfig, queue_id: str, record: dict[str, Any] | None) -> str:
    """The state the queue's primaries follow: the control record's, else what the site file starts it in."""
    if record is not None:
        return str(record["state"])
    sender = next((s for s in cfg.gateway_senders if s.id == queue_id), None)
    if sender is not None and sender.manual_start:
        return "STOPPED"
    queue = next((q for q in cfg.async_event_queues if q.id == queue_id), None)
    return "PAUSED" if queue is not None and queue.pause_event_processing else "RUNNING"


def plan_clean(cfg: SiteConfig, queue_id: str, issued_by: str) -> CleanPlan:
    """What a clean start of ``queue_id`` drops now; InvalidRequest for a queue that cannot have one,
    NotStopped for a sender that is not stopped."""
    kind = kind_of(cfg, queue_id)
    if kind != "gateway-sender":
        raise InvalidRequest("--clean-queues", queue_id, "is an async event queue: a clean start is a gateway "
                             "sender's (Geode's start gateway-sender --clean-queues; an async event queue has none)")
    state = desired_state(cfg, queue_id, control_record(cfg, queue_id))
    if state != "STOPPED":
        raise NotStopped("--clean-queues", queue_id, f"the sender is {state}: stop it first (sluice admin stop "
                         f"{queue_id}); as in Geode, a clean start starts a stopped sender")
    topic = cfg.topics.queue(queue_id)
    partitions = next(q.partitions for q in cfg.all_attached_queues() if q.id == queue_id)
    codec = get_codec()
    consumer = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 50})
    try:
        with kafka_errors(f"reading the queue of {queue_id}"):
            heads: dict[int, int] = {}
            for msg in read_to_end(consumer, cfg.topics.removals(queue_id)):
                try:
                    removal = codec.decode_as("RemovalRecord", msg.value())
                    heads[int(msg.key() or b"")] = removal["last_removed_offset"] + 1
                except (CodecError, ValueError):
                    continue  # another kind of record (a sender's epoch marker)
            plans = []
            for p in range(partitions):
                # A read_committed reader's end: the last stable offset.  Below it everything is decided; an event
                # whose transaction is still open lies at or above it and is kept.
                low, cut = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                head = max(low, heads.get(p, low))
                events = count_events(consumer, topic, p, head, cut, limit=SIZE_COUNT_LIMIT) if head < cut else 0
                plans.append(PartitionPlan(p, head, max(cut, head), events))
    finally:
        consumer.close()
    return CleanPlan(queue_id, kind, plans, CleanRequest.new([p.cut for p in plans], issued_by))


def print_plan(console: Console, plan: CleanPlan) -> None:
    table = Table(title=f"clean start of gateway sender {plan.queue_id}: what its queue holds now is dropped")
    for col in ("partition", "queue head", "new head", "events dropped"):
        table.add_column(col, justify="right")
    for p in plan.partitions:
        table.add_row(str(p.partition), str(p.head), str(p.cut), p.events_text)
    console.print(table)


def confirmed(console: Console, plan: CleanPlan, *, yes: bool, stdin: TextIO) -> bool:
    """``--yes``, or the operator typed yes; InvalidRequest when there is nobody to ask."""
    if yes:
        return True
    if not stdin.isatty():
        raise InvalidRequest("--yes", None, "--clean-queues drops queued events: confirm at a terminal, or give "
                             "--yes in a script")
    total = f"{plan.events}" if plan.counted else f"up to {plan.events}"
    console.print(f"Drop {total} events of gateway sender {plan.queue_id} and start it? Type yes to go on: ", end="")
    return stdin.readline().strip().lower() == "yes"


def wait_applied(cfg: SiteConfig, plan: CleanPlan, timeout_s: float,
                 progress: Callable[[int, int], None] | None = None) -> list[CleanAudit]:
    """The audits of the request once every partition's is APPLIED, or those applied when ``timeout_s``
    runs out."""
    end = time.monotonic() + timeout_s
    wanted = len(plan.partitions)
    applied: list[CleanAudit] = []
    while True:
        applied = [a for a in _audits(cfg, plan.kind, plan.queue_id, plan.request.request_id) if a.applied]
        if progress is not None:
            progress(len(applied), wanted)
        if len(applied) >= wanted or time.monotonic() >= end:
            return sorted(applied, key=lambda a: a.partition)
        time.sleep(0.5)


def _audits(cfg: SiteConfig, kind: str | None = None, queue_id: str | None = None,
            request_id: str | None = None) -> list[CleanAudit]:
    consumer = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 50})
    try:
        with kafka_errors("reading the clean audits"):
            return read_audits(consumer, cfg.topics.status(), kind, queue_id, request_id)
    finally:
        consumer.close()


def run_clean_start(console: Console, cfg: SiteConfig, args: argparse.Namespace, stdin: TextIO = sys.stdin) -> int:
    """``start QUEUE --clean-queues [--yes] [--wait-s S]``: plan, confirm, request, follow the audits."""
    plan = plan_clean(cfg, args.queue, issuer("sluice admin"))
    print_plan(console, plan)
    if not confirmed(console, plan, yes=args.yes, stdin=stdin):
        console.print("not confirmed: nothing dropped, the sender stays stopped")
        return 1
    set_state(cfg, args.queue, "RUNNING", issued_by=plan.request.issued_by, clean=plan.request)
    console.print(f"gateway sender {args.queue}: start with clean queues requested (clean {plan.request.request_id}); "
                  "waiting for its primaries to apply it")
    last = [-1]

    def progress(done: int, wanted: int) -> None:
        if done != last[0]:
            last[0] = done
            console.print(f"  applied on {done} of {wanted} partitions")

    applied = wait_applied(cfg, plan, args.wait_s, progress)
    print_audits(console, plan.queue_id, applied)
    missing = sorted({p.partition for p in plan.partitions} - {a.partition for a in applied})
    if missing:
        console.print(f"[yellow]not applied yet on partitions {missing}[/yellow]: no primary has taken them within "
                      f"{args.wait_s:g} s. The request is kept with the sender's state; the primary that takes them "
                      "applies it before it sends anything of them (`sluice admin status` shows when)")
    else:
        console.print(f"gateway sender {args.queue}: {sum(a.dropped for a in applied)} events dropped; started")
    return 0


def print_audits(console: Console, queue_id: str, audits: list[CleanAudit]) -> None:
    table = Table(title=f"clean start of {queue_id}: what each partition's primary dropped")
    for col in ("partition", "events dropped", "offsets dropped", "applied by", "applied at"):
        table.add_column(col, justify="right" if col in ("partition", "events dropped") else "left")
    for a in audits:
        table.add_row(str(a.partition), str(a.dropped), _span(a), a.applied_by, _clock(a.applied_at))
    console.print(table)


# --- history: sluice admin status and the status page --------------------------------------


@dataclass
class CleanPartition:
    partition: int
    cut: int
    #: applied, applying, pending (no primary has applied it yet), superseded (a later clean covers it)
    state: str
    dropped: int | None = None
    head: int | None = None
    applied_by: str | None = None
    applied_at: int | None = None


@dataclass
class CleanRow:
    """One clean start of a queue and what each of its partitions' primaries dropped."""

    queue_id: str
    kind: str
    request_id: str
    issued_by: str
    issued_at: int
    partitions: list[CleanPartition] = field(default_factory=list)

    @property
    def dropped(self) -> int:
        return sum(p.dropped or 0 for p in self.partitions)

    @property
    def applied(self) -> int:
        return sum(1 for p in self.partitions if p.state == "applied")

    def to_dict(self) -> dict[str, Any]:
        return {"queue_id": self.queue_id, "kind": self.kind, "request_id": self.request_id,
                "issued_by": self.issued_by, "issued_at": self.issued_at, "dropped": self.dropped,
                "applied": self.applied, "partitions": [asdict(p) for p in self.partitions]}


def clean_history(cfg: SiteConfig, queue_id: str | None = None) -> list[CleanRow]:
    """Every clean start of the site's senders (or of ``queue_id``) that the control and status topics know,
    newest first: the current request of each sender, and every request with audits."""
    senders = [s.id for s in cfg.gateway_senders if queue_id is None or s.id == queue_id]
    rows: dict[tuple[str, str], CleanRow] = {}
    current: dict[str, CleanRequest] = {}
    consumer = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 50})
    try:
        with kafka_errors(f"reading {cfg.topics.control()}"):
            controls = read_compacted(consumer, cfg.topics.control())
    finally:
        consumer.close()
    codec = get_codec()
    for sender in senders:
        try:
            value = controls.get(f"gateway-sender/{sender}".encode())
            record = codec.decode_as("ControlRecord", value) if value is not None else None
        except CodecError:
            record = None
        if record is not None and record.get("clean") is not None:
            request = CleanRequest.from_record(record["clean"])
            current[sender] = request
            rows[(sender, request.request_id)] = CleanRow(sender, "gateway-sender", request.request_id,
                                                          request.issued_by, request.issued_at,
                                                          [CleanPartition(p, cut, "pending")
                                                           for p, cut in enumerate(request.offsets)])
    for audit in _audits(cfg, "gateway-sender"):
        if audit.queue_id not in senders:
            continue
        row = rows.setdefault((audit.queue_id, audit.request_id), CleanRow(
            audit.queue_id, audit.kind, audit.request_id, audit.issued_by, audit.issued_at))
        entry = next((p for p in row.partitions if p.partition == audit.partition), None)
        if entry is None:
            entry = CleanPartition(audit.partition, audit.cut_offset, "pending")
            row.partitions.append(entry)
        entry.state = "applied" if audit.applied else "applying"
        entry.dropped, entry.head = audit.dropped, audit.head_offset
        entry.applied_by, entry.applied_at = audit.applied_by, audit.applied_at
    for (sender, request_id), row in rows.items():
        row.partitions.sort(key=lambda p: p.partition)
        newest = current.get(sender)
        if newest is None or newest.request_id != request_id:
            for p in row.partitions:
                if p.state == "pending":
                    p.state = "superseded"
    return sorted(rows.values(), key=lambda r: r.issued_at, reverse=True)


def print_cleans(console: Console, cfg: SiteConfig, rows: list[CleanRow]) -> None:
    """One row per clean start: who asked and when, and per partition what was dropped (no table when
    there was none)."""
    if not rows:
        return
    table = Table(title=f"clean starts of the gateway senders of site {cfg.site} (start --clean-queues): events "
                        "dropped per partition")
    for col in ("queue", "asked by", "asked at", "applied", "events dropped", "per partition (events dropped)",
                "applied by"):
        table.add_column(col, justify="right" if col in ("applied", "events dropped") else "left")
    for r in rows:
        parts = ", ".join(f"{p.partition}: {p.dropped}" if p.dropped is not None else f"{p.partition}: {p.state}"
                          for p in r.partitions)
        by = sorted({p.applied_by for p in r.partitions if p.applied_by})
        table.add_row(r.queue_id, r.issued_by or "?", _clock(r.issued_at), f"{r.applied}/{len(r.partitions)}",
                      str(r.dropped), parts, ", ".join(by) or "—")
    console.print(table)


def _span(audit: CleanAudit) -> str:
    return "none" if audit.cut_offset <= audit.head_offset else f"{audit.head_offset}–{audit.cut_offset - 1}"


def _clock(ms: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) if ms else "—"


__all__ = ["CleanPlan", "CleanRow", "NotStopped", "clean_history", "plan_clean", "print_cleans", "run_clean_start",
           "wait_applied"]
