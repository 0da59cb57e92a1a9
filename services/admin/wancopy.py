"""``sluice admin -c FILE wan-copy --region R --sender-id S [--max-rate N] [--batch-size N] [--cancel]``.

Geode's ``gfsh wan-copy region``: copy a region's current entries to the
remote site of one of its gateway senders, to bring a new or repaired site up
to date.  The region service does the copy (``sluice.region.wancopy`` tells
how); this command starts it on one instance of the site (``--url``, else
the first live one of the owner directory), follows it with a progress
display (entries copied per bucket and in all), and ends with a table per
bucket and a summary.  Ctrl-C cancels the copy.  ``--cancel`` stops a copy
that another command started: it asks every live instance, as gfsh asks
every member.  ``--wait`` also waits until the sender has delivered every
record the copy queued (the sender's queue head past where the queue ended
when the copy finished).

The functions here (``instance_urls``, ``CopyClient``, ``run_copy``,
``queue_ends``, ``wait_delivered``) are what ``sluice pipeline reconcile
--repair`` uses too.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..core.codec import get_codec
from ..core.config import SiteConfig, load_config
from ..core.directory import MemberTrust, live_urls, read_instances
from ..core.errors import CodecError, ConfigError, InvalidRequest, SluiceError
from ..core.kafka import TopicPartition, kafka_errors, make_consumer, read_to_end
from ..core.wancopy import BATCH_SIZE_DEFAULT, BATCH_SIZE_MAX

__all__ = ["CopyClient", "EXAMPLE", "add_options", "instance_urls", "queue_ends", "run", "run_copy",
           "wait_delivered"]

EXAMPLE = """\
wan-copy (Geode's wan-copy region: bring a new or repaired site up to date):
  sluice admin -c deploy/sites/site-a.yaml wan-copy --region orders --sender-id orders-to-b
  sluice admin -c deploy/sites/site-a.yaml wan-copy --region orders --sender-id orders-to-b \\
      --max-rate 5000 --batch-size 500 --wait
  sluice admin -c deploy/sites/site-a.yaml wan-copy --region orders --sender-id orders-to-b --cancel

  Every live entry of the region goes into the sender's queue, in batches, each
  entry with its own EventID and version tag; the remote site applies them as
  any gateway event (repeats and older versions are not applied twice).  Exit
  status: 0 copied (cancel: a copy was stopped), 1 failed, cancelled or nothing
  to cancel, 2 bad input.
"""

#: How often the command asks the coordinating instance for the copy's progress.
POLL_S = 0.5
#: Without a terminal, how often a progress line is printed.
LINE_EVERY_S = 2.0


def add_options(parser: argparse.ArgumentParser) -> None:
    """The options only ``wan-copy`` reads."""
    group = parser.add_argument_group("wan-copy options")
    group.add_argument("--region", help="the region to copy")
    group.add_argument("--sender-id", help="the gateway sender (of the region) to copy through")
    group.add_argument("--max-rate", type=int, default=0,
                       help="most entries per second for the whole copy (default 0: no limit)")
    group.add_argument("--batch-size", type=int, default=BATCH_SIZE_DEFAULT,
                       help=f"entries per batch, 1 to {BATCH_SIZE_MAX} (default {BATCH_SIZE_DEFAULT}, Geode's)")
    group.add_argument("--cancel", action="store_true", help="stop the running copy of the region through the sender")
    group.add_argument("--wait", action="store_true",
                       help="after the copy, wait until the sender has delivered everything it queued")
    group.add_argument("--url", help="a region-service instance to coordinate the copy (default: the first live "
                                     "instance of the site's owner directory)")
    group.add_argument("--timeout-s", type=float, default=3600.0,
                       help="give up waiting for the copy (and with --wait, its delivery) after this long "
                            "(default 3600); the copy itself goes on")


# --- the region service's API, from outside ------------------------------------------------------


def instance_urls(cfg: SiteConfig) -> list[str]:
    """The live region-service instances of the site, from its owner directory (believed records only)."""
    with kafka_errors(f"reading the owner directory of site {cfg.site}"):
        instances = read_instances(cfg)
    urls = live_urls(instances, trust=MemberTrust.from_config(cfg))
    if not urls:
        raise SluiceError(f"no region-service instance of site {cfg.site} is running (none in its owner "
                          f"directory, topic {cfg.topics.status()})")
    return urls


class CopyClient:
    """The wan-copy paths of the region API, with the site's client token."""

    def __init__(self, cfg: SiteConfig, timeout_s: float = 60.0) -> None:
        token = cfg.region_service.token
        headers = {"content-type": "application/json"}
        if token is not None:
            headers["authorization"] = f"Bearer {token.get_secret_value()}"
        self._http = httpx.Client(timeout=timeout_s, headers=headers)

    def start(self, url: str, region: str, sender_id: str, *, max_rate: int, batch_size: int,
              keys: list[str] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"sender_id": sender_id, "max_rate": max_rate, "batch_size": batch_size}
        if keys is not None:
            body["keys"] = keys
        return self._answer(self._http.post(f"{url}/regions/{region}/wan_copy", json=body), (202,))

    def status(self, url: str, region: str, sender_id: str, copy_id: str | None = None) -> dict[str, Any] | None:
        params = {"sender_id": sender_id, **({"copy_id": copy_id} if copy_id else {})}
        resp = self._http.get(f"{url}/regions/{region}/wan_copy", params=params)
        return None if resp.status_code == 404 else self._answer(resp, (200,))

    def cancel(self, url: str, region: str, sender_id: str) -> dict[str, Any] | None:
        """The copy once stopped; None when none runs on that instance."""
        resp = self._http.post(f"{url}/regions/{region}/wan_copy/cancel", json={"sender_id": sender_id})
        return None if resp.status_code == 404 else self._answer(resp, (200,))

    @staticmethod
    def _answer(resp: httpx.Response, ok: tuple[int, ...]) -> dict[str, Any]:
        try:
            data = resp.json()
        except ValueError:
            data = {"message": resp.text[:200]}
        if resp.status_code in ok:
            return dict(data)
        message = data.get("message", data) if isinstance(data, dict) else data
        if 400 <= resp.status_code < 500 and resp.status_code not in (401, 403, 421):
            raise InvalidRequest(str(data.get("field") or "request") if isinstance(data, dict) else "request",
                                 None, f"{resp.request.url} answered {resp.status_code}: {message}")
        raise SluiceError(f"{resp.request.url} answered {resp.status_code}: {message}")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "CopyClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_copy(cfg: SiteConfig, region: str, sender_id: str, *, max_rate: int = 0, batch_size: int = BATCH_SIZE_DEFAULT,
             keys: list[str] | None = None, url: str | None = None, timeout_s: float = 3600.0,
             on_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Start a copy on ``url`` (else the first live instance), follow it until it ends, and return its
    last state (``state``: done, cancelled or failed).  A KeyboardInterrupt cancels it first."""
    check_copy(cfg, region, sender_id, max_rate, batch_size)
    url = url.rstrip("/") if url else instance_urls(cfg)[0]
    with CopyClient(cfg) as client:
        copy = client.start(url, region, sender_id, max_rate=max_rate, batch_size=batch_size, keys=keys)
        deadline = time.monotonic() + timeout_s
        try:
            while copy["state"] == "running":
                if on_progress is not None:
                    on_progress(copy)
                if time.monotonic() > deadline:
                    raise SluiceError(f"wan-copy {copy['copy_id']} still running after {timeout_s:g} s "
                                      f"({copy['copied']:,} of {copy['total']:,} entries copied)")
                time.sleep(POLL_S)
                found = client.status(url, region, sender_id, copy["copy_id"])
                if found is None:
                    raise SluiceError(f"{url} no longer knows wan-copy {copy['copy_id']}: the instance restarted")
                copy = found
        except KeyboardInterrupt:
            copy = client.cancel(url, region, sender_id) or copy
        if on_progress is not None:
            on_progress(copy)
        return copy


def check_copy(cfg: SiteConfig, region: str | None, sender_id: str | None, max_rate: int, batch_size: int) -> None:
    """What the site file says against the options, before any request: ``InvalidRequest`` naming the option."""
    if not region:
        raise InvalidRequest("--region", region, "wan-copy needs --region")
    if not sender_id:
        raise InvalidRequest("--sender-id", sender_id, "wan-copy needs --sender-id")
    names = [r.name for r in cfg.regions]
    if region not in names:
        raise InvalidRequest("--region", region, f"no such region in site {cfg.site}'s file (it has "
                                                 f"{', '.join(names)})")
    senders = list(cfg.region(region).gateway_senders)
    if sender_id not in senders:
        raise InvalidRequest("--sender-id", sender_id, f"region {region} does not feed that gateway sender "
                                                       f"(its senders: {', '.join(senders) or 'none'})")
    if max_rate < 0:
        raise InvalidRequest("--max-rate", max_rate, "entries per second: 0 (no limit) or more")
    if not 1 <= batch_size <= BATCH_SIZE_MAX:
        raise InvalidRequest("--batch-size", batch_size, f"from 1 to {BATCH_SIZE_MAX}")


# --- the sender's queue: where it ended, and whether the sender has delivered that far -------------------


def queue_ends(cfg: SiteConfig, sender_id: str) -> list[int]:
    """The end offset of each partition of the sender's queue, now."""
    topic = cfg.topics.queue(sender_id)
    partitions = next(q.partitions for q in cfg.all_attached_queues() if q.id == sender_id)
    consumer = make_consumer(cfg.kafka.client_settings(), None)
    try:
        with kafka_errors(f"reading the end of queue {sender_id}"):
            return [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)]
    finally:
        consumer.close()


def undelivered(cfg: SiteConfig, sender_id: str, ends: list[int]) -> list[int]:
    """The partitions of the sender's queue still holding a committed record below ``ends``: the head (from
    the queue's removals) is below it, and a record lies between them (transaction markers occupy
    offsets too, so a head one short of an end can be all there is)."""
    codec = get_codec()
    names = cfg.topics
    consumer = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 50,
                                                                    "isolation.level": "read_committed"})
    try:
        with kafka_errors(f"reading the head of queue {sender_id}"):
            heads: dict[int, int] = {}
            for msg in read_to_end(consumer, names.removals(sender_id)):
                if msg.key() is None or msg.value() is None:
                    continue
                try:
                    removal = codec.decode_as("RemovalRecord", msg.value())
                    heads[int(msg.key())] = removal["last_removed_offset"] + 1
                except (CodecError, ValueError):
                    continue
            waiting = []
            for p, end in enumerate(ends):
                head = heads.get(p, 0)
                if head >= end:
                    continue
                for msg in read_to_end(consumer, names.queue(sender_id), p, start=head):
                    if msg.offset() < end:
                        waiting.append(p)
                    break
            return waiting
    finally:
        consumer.close()


def wait_delivered(cfg: SiteConfig, sender_id: str, ends: list[int], timeout_s: float,
                   say: Callable[[str], None] | None = None) -> None:
    """Until the sender has delivered (the remote site acknowledged) every record below ``ends``;
    ``SluiceError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    said = 0.0
    while True:
        waiting = undelivered(cfg, sender_id, ends)
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise SluiceError(f"sender {sender_id} has not delivered the copy in {timeout_s:g} s (partitions "
                              f"{waiting} still hold it): is the sender running and the remote receiver?")
        if say is not None and time.monotonic() - said >= LINE_EVERY_S:
            say(f"waiting for sender {sender_id} to deliver the copy: {len(waiting)} of {len(ends)} queue "
                "partitions still hold some of it")
            said = time.monotonic()
        time.sleep(POLL_S)


# --- the command --------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """``sluice admin … wan-copy``; the exit status (EXAMPLE)."""
    console = Console() if sys.stdout.isatty() else Console(width=160)
    try:
        cfg = load_config(args.config)
        if args.bootstrap:
            cfg = cfg.with_overrides({"kafka": {"bootstrap_servers": args.bootstrap}})
        if args.queue:
            raise InvalidRequest("queue", args.queue, "wan-copy names its sender with --sender-id")
        check_copy(cfg, args.region, args.sender_id, args.max_rate, args.batch_size)
        if args.cancel:
            return _cancel(console, cfg, args)
        urls = [args.url.rstrip("/")] if args.url else instance_urls(cfg)
        with CopyClient(cfg) as client:
            for url in urls:
                running = client.status(url, args.region, args.sender_id)
                if running is not None and running["state"] == "running":
                    raise InvalidRequest("--sender-id", args.sender_id, f"wan-copy {running['copy_id']} of region "
                                         f"{args.region} through it is running on {url}; --cancel it first")
        show = _Display(console)
        try:
            copy = run_copy(cfg, args.region, args.sender_id, max_rate=args.max_rate, batch_size=args.batch_size,
                            url=urls[0], timeout_s=args.timeout_s, on_progress=show)
        finally:
            show.close()
        print_copy(console, copy)
        if copy["state"] == "done" and args.wait:
            ends = queue_ends(cfg, args.sender_id)
            started = time.monotonic()
            wait_delivered(cfg, args.sender_id, ends, args.timeout_s,
                           lambda line: console.print(f"{time.strftime('%H:%M:%S')} {line}", markup=False))
            console.print(f"sender {args.sender_id} delivered the copy to dsid {copy['remote_dsid']} "
                          f"{time.monotonic() - started:.1f} s after it was queued")
        return 0 if copy["state"] == "done" else 1
    except (ConfigError, InvalidRequest) as exc:
        print(f"sluice admin wan-copy: {exc}", file=sys.stderr)
        return 2
    except (SluiceError, httpx.HTTPError) as exc:
        print(f"sluice admin wan-copy: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sluice admin wan-copy: interrupted", file=sys.stderr)
        return 130


def _cancel(console: Console, cfg: SiteConfig, args: argparse.Namespace) -> int:
    """Ask every live instance (or ``--url``) to stop its copy of the region through the sender; a table of
    what each answered, as gfsh prints one row per member."""
    urls = [args.url.rstrip("/")] if args.url else instance_urls(cfg)
    table = Table(title=f"wan-copy --cancel of region {args.region} through sender {args.sender_id}")
    for column in ("instance", "status", "message"):
        table.add_column(column)
    stopped = 0
    with CopyClient(cfg) as client:
        for url in urls:
            try:
                copy = client.cancel(url, args.region, args.sender_id)
            except (SluiceError, httpx.HTTPError) as exc:
                table.add_row(url, "ERROR", str(exc))
                continue
            if copy is None:
                table.add_row(url, "—", "no running copy to cancel")
                continue
            stopped += 1
            table.add_row(url, copy["state"].upper(),
                          f"copy {copy['copy_id']} stopped after having copied {copy['copied']:,} of "
                          f"{copy['total']:,} entries")
    console.print(table)
    if not stopped:
        console.print(f"no running wan-copy of region {args.region} through sender {args.sender_id} to cancel")
    return 0 if stopped else 1


class _Display:
    """The copy's progress: a bar for the whole copy and one per bucket being copied on a terminal; a line
    every ``LINE_EVERY_S`` otherwise."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress: Progress | None = None
        self.tasks: dict[Any, Any] = {}
        self.last_line = 0.0
        if console.is_terminal:
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=console,
                                     transient=True)
            self.progress.start()

    def __call__(self, copy: dict[str, Any]) -> None:
        rate = f"{copy['rate']:,.0f}/s"
        if self.progress is None:
            now = time.monotonic()
            if now - self.last_line < LINE_EVERY_S and copy["state"] == "running":
                return
            self.last_line = now
            busy = [b for b in copy["buckets"] if not b["done"] and b["copied"]]
            if copy["state"] == "running" and not copy["total"] and not copy["copied"]:
                self.console.print(f"{time.strftime('%H:%M:%S')} wan-copy {copy['region']} → {copy['sender_id']}: "
                                   "counting the entries of each bucket", markup=False)
                return
            self.console.print(
                f"{time.strftime('%H:%M:%S')} wan-copy {copy['region']} → {copy['sender_id']}: {copy['copied']:,} of "
                f"{copy['total']:,} entries copied, {rate}, buckets done {copy['buckets_done']}/{len(copy['buckets'])}"
                + ("; copying " + ", ".join(f"[{b['bucket']}] {b['copied']:,}/{b['total']:,}" for b in busy[:8])
                   if busy else ""), markup=False)
            return
        total = self.tasks.get("total")
        if total is None:
            total = self.tasks["total"] = self.progress.add_task(f"{copy['region']} → {copy['sender_id']}",
                                                                 total=copy["total"] or None, rate=rate)
        self.progress.update(total, completed=copy["copied"], total=copy["total"] or None, rate=rate)
        for b in copy["buckets"]:
            task = self.tasks.get(b["bucket"])
            active = not b["done"] and b["copied"] > 0
            if task is None and active:
                task = self.tasks[b["bucket"]] = self.progress.add_task(f"  bucket {b['bucket']}",
                                                                        total=b["total"] or None, rate="")
            if task is not None:
                self.progress.update(task, completed=b["copied"], total=b["total"] or None, visible=active)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def print_copy(console: Console, copy: dict[str, Any]) -> None:
    """The table per bucket, and the summary."""
    table = Table(title=f"wan-copy of {copy['region']} → {copy['sender_id']} (dsid {copy['remote_dsid']})")
    for column in ("bucket", "entries", "copied", "skipped", "done"):
        table.add_column(column, justify="right")
    for b in copy["buckets"]:
        table.add_row(str(b["bucket"]), f"{b['total']:,}", f"{b['copied']:,}", f"{b['skipped']:,}",
                      "yes" if b["done"] else "no")
    console.print(table)
    skipped = ", ".join(f"{n:,} {reason.replace('_', ' ')}" for reason, n in copy["skipped"].items() if n)
    rate = f"{copy['max_rate']:,}/s" if copy["max_rate"] else "no limit"
    console.print(
        f"{copy['state'].upper()}: {copy['copied']:,} of {copy['total']:,} entries copied in {copy['elapsed_s']:.1f} s "
        f"({copy['rate']:,.0f} entries/s; max rate {rate}, batches of {copy['batch_size']:,}); copy "
        f"{copy['copy_id']}, coordinated by {copy['coordinator']}"
        + (f"; skipped {skipped}" if skipped else "")
        + (f"; error: {copy['error']}" if copy.get("error") else ""), markup=False)
    if copy["state"] == "done":
        console.print(f"the entries are in sender {copy['sender_id']}'s queue; it delivers them in queue order "
                      "(--wait waits for that)")
