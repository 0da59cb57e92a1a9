"""``sluice admin -c FILE {status|pause|resume|stop|start} [QUEUE]``, and ``serve`` (the status page, serve.py).

Commands travel through Kafka: pause, resume, stop and start write the
queue's desired state to the site's compacted control topic, which every
dispatcher of the queue follows.  Status is computed from Kafka too: the
queue head from the removals topic, the queue's end offsets, the record at
the head (its age), and what each partition's primary last reported.
Subscription clients come from the registry and acks topics, each client's
queue (its end, and the age of its oldest unacknowledged message) and the
subscription instances' consumer group (who is primary for whom).

What this command reads, other parts of Sluice read too, so the readers are
in the core and this module only shows them: queue and receiver reports
(``sluice.core.statusread``, which the fault harness also waits on), the
receivers' figures per inbound partition (``sluice.core.receivertotals``),
the region instances' claims (``sluice.core.directory``) and the rules a
subscription client's records must pass (``sluice.core.clientregistry``).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from ..core.clientregistry import (
    DURABLE_CLIENT_TIMEOUT,
    QUEUE_DROPPED,
    check_ack,
    check_authorized,
    check_registration,
    configured_token,
    last_heard,
    registry_partition,
    unregistered_reason,
)
from ..core.codec import get_codec
from ..core.config import SiteConfig, load_config
from ..core.control import RECEIVER_ID, RECEIVER_KIND, write_desired_state
from ..core.directory import owners_of, read_instances, standbys_of
from ..core.errors import CodecError, ConfigError, InvalidRequest, SluiceError
from ..core.queueclean import CleanRequest
from ..core.kafka import (
    TopicPartition,
    describe_group_members,
    kafka_errors,
    make_admin,
    make_consumer,
    make_producer,
    read_to_end,
)
from ..core.receivertotals import PartitionTotals, site_totals, summed
from ..core.statusread import PartitionStatus, kind_of, queue_status, read_compacted, receiver_status

STATES = {"pause": "PAUSED", "resume": "RUNNING", "stop": "STOPPED", "start": "RUNNING"}

EXAMPLE = """\
examples:
  sluice admin -c deploy/sites/site-a.yaml status                 # every queue per partition, receivers, clients
  sluice admin -c deploy/sites/site-a.yaml status --json | jq '.receiver_totals.events_applied'
  sluice admin -c deploy/sites/site-b.yaml start --receiver       # receivers with receiver.manual_start apply
  sluice admin -c deploy/sites/site-a.yaml pause orders-jdbc      # dispatch stops at a batch boundary
  sluice admin -c deploy/sites/site-a.yaml resume orders-jdbc
  sluice admin -c deploy/sites/site-a.yaml stop orders-jdbc       # also closes the listener; nothing is dropped
  sluice admin -c deploy/sites/site-a.yaml start orders-jdbc
  sluice admin -c deploy/sites/site-a.yaml stop orders-to-site-b
  sluice admin -c deploy/sites/site-a.yaml start orders-to-site-b --clean-queues   # drop what its queue holds, start it
  sluice admin -c deploy/sites/site-a.yaml start orders-to-site-b --clean-queues --yes --wait-s 120   # a script
"""


def add_parser(subparsers: Any) -> None:
    from . import serve, wancopy

    p = subparsers.add_parser(
        "admin",
        help="status of queues (gateway senders, async event queues), pause/resume/stop/start them, "
        "serve the status page, or wan-copy a region to a remote site",
        description="Show the status of a site's gateway senders and async event queues per partition, "
        "change their state, or serve a status page (tables and a chart, refreshed every 2 s) with the same "
        "data as JSON and the same actions as buttons; wan-copy copies a region's entries to a remote site "
        "through a gateway sender (Geode's wan-copy region).",
        epilog=EXAMPLE + "\n" + serve.EXAMPLE + "\n" + wancopy.EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-c", "--config", required=True, help="site configuration file")
    p.add_argument("--bootstrap", help="override kafka.bootstrap_servers")
    p.add_argument("command", choices=("status", "pause", "resume", "stop", "start", "serve", "wan-copy"))
    p.add_argument("queue", nargs="?", help="queue id (status: all queues when left out)")
    p.add_argument("--json", action="store_true",
                   help="status: print one JSON document instead of tables, the one the status page serves as "
                        "/api/status (its fields: docs/status-json.md)")
    p.add_argument("--receiver", action="store_true",
                   help="start, stop: the site's gateway receiver processes instead of a queue (receiver.manual_start "
                        "makes them start stopped)")
    clean = p.add_argument_group("start --clean-queues (a stopped gateway sender)")
    clean.add_argument("--clean-queues", action="store_true",
                       help="start: drop every event the sender's queue holds now, then start it (Geode's start "
                            "gateway-sender --clean-queues); events written after are kept. Asks for confirmation; "
                            "the audit (events dropped per partition, by whom, when) shows in `status`")
    clean.add_argument("--yes", action="store_true", help="start --clean-queues: do not ask for confirmation")
    clean.add_argument("--wait-s", type=float, default=60.0,
                       help="start --clean-queues: how long to wait for the primaries to apply it (default 60)")
    serve.add_options(p)
    wancopy.add_options(p)
    p.set_defaults(func=lambda args: wancopy.run(args) if args.command == "wan-copy" else run(args))


def run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        from . import serve

        return serve.run(args)
    # Piped (a log, CI, watch): wide enough that no column is cut.
    console = Console() if sys.stdout.isatty() else Console(width=220)
    try:
        cfg = load_config(args.config)
        if args.bootstrap:
            cfg = cfg.with_overrides({"kafka": {"bootstrap_servers": args.bootstrap}})
        if args.command == "status" and args.json:
            if args.queue:
                print("sluice admin status --json: takes no queue (the document holds every queue)", file=sys.stderr)
                return 2
            print_json(cfg)
            return 0
        if args.command == "status":
            queues = [args.queue] if args.queue else [q.id for q in cfg.all_attached_queues()]
            for queue_id in queues:
                kind_of(cfg, queue_id)
            rows = [row for queue_id in queues for row in queue_status(cfg, queue_id)]
            print_status(console, cfg, rows)
            if cfg.receiver is not None and not args.queue:
                reports = receiver_status(cfg)
                print_receivers(console, cfg, reports)
                print_receiver_partitions(console, cfg, site_totals(cfg))
                print_senders(console, cfg, reports)
            if not args.queue:
                print_clients(console, cfg, client_status(cfg))
                print_buckets(console, cfg, bucket_status(cfg))
            from .clean import clean_history, print_cleans

            print_cleans(console, cfg, clean_history(cfg, args.queue))
            return 0
        if (args.clean_queues or args.yes) and (args.command != "start" or args.receiver or not args.clean_queues):
            print("sluice admin: --clean-queues goes with start QUEUE (a gateway sender), and --yes confirms it",
                  file=sys.stderr)
            return 2
        if args.receiver:
            return steer_receiver(console, cfg, args)
        if not args.queue:
            print(f"sluice admin {args.command}: name the queue", file=sys.stderr)
            return 2
        kind_of(cfg, args.queue)
        if args.clean_queues:
            from .clean import run_clean_start

            return run_clean_start(console, cfg, args)
        set_state(cfg, args.queue, STATES[args.command], issued_by="sluice admin")
        console.print(f"queue {args.queue}: {args.command} requested ({STATES[args.command]}); "
                      f"its dispatchers follow within a poll")
        return 0
    except (ConfigError, InvalidRequest) as exc:
        print(f"sluice admin: {exc}", file=sys.stderr)
        return 2
    except SluiceError as exc:
        print(f"sluice admin: {exc}", file=sys.stderr)
        return 1


def set_state(cfg: SiteConfig, queue_id: str, state: str, issued_by: str = "",
              clean: CleanRequest | None = None) -> None:
    """Write the queue's desired state to the control topic and wait until it is durable.

    ``clean``: a clean start rides on the record (clean.py, core/queueclean.py).  Without one the record
    carries on the queue's last clean, so that the compacted topic, which keeps only the latest record
    of the queue, still holds it for a primary that starts later."""
    kind = kind_of(cfg, queue_id)
    carried = clean.to_record() if clean is not None else (control_record(cfg, queue_id) or {}).get("clean")
    producer = make_producer(cfg.kafka.client_settings())
    record = {"kind": kind, "target_id": queue_id, "state": state, "issued_by": issued_by,
              "issued_at": int(time.time() * 1000), "clean": carried}
    errors: list[Any] = []
    producer.produce(cfg.topics.control(), get_codec().encode("ControlRecord", record),
                     f"{kind}/{queue_id}".encode(), on_delivery=lambda err, _m: errors.append(err))
    if producer.flush(30) or errors != [None]:
        raise SluiceError(f"control record for {queue_id} not acknowledged: {errors}")


def control_record(cfg: SiteConfig, queue_id: str) -> dict[str, Any] | None:
    """The queue's latest control record (None: nobody asked for anything yet)."""
    key = f"{kind_of(cfg, queue_id)}/{queue_id}".encode()
    consumer = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 50})
    try:
        with kafka_errors(f"reading {cfg.topics.control()}"):
            value = read_compacted(consumer, cfg.topics.control()).get(key)
    finally:
        consumer.close()
    if value is None:
        return None
    try:
        return get_codec().decode_as("ControlRecord", value)
    except CodecError as exc:
        raise SluiceError(f"the control record of {queue_id} does not read: {exc}") from exc


def print_receivers(console: Console, cfg: SiteConfig, reports: list[dict[str, Any]]) -> None:
    table = Table(title=f"gateway receivers of site {cfg.site} (dsid {cfg.dsid}); "
                        f"accepted dsids {sorted(cfg.receiver.accepted_dsids) if cfg.receiver else []}")
    for col in ("receiver", "state", "partitions", "batches", "duplicate batches", "rejected", "bad signatures",
                "events applied", "repeats discarded", "conflicts lost", "refused events"):
        table.add_column(col, justify="left" if col in ("receiver", "state", "partitions") else "right")
    for r in reports:
        state = r.get("state", "running") if r["age_s"] < 30 else f"no report for {r['age_s']:.0f}s"
        table.add_row(r["member"], state, ",".join(map(str, r["partitions"])) or "—", str(r["batches"]),
                      str(r["duplicate_batches"]), str(r["rejected_batches"]), str(r["bad_signatures"]),
                      str(r["events_applied"]), str(r["events_duplicate"]), str(r["conflicts"]), str(r["exceptions"]))
    console.print(table)


def print_receiver_partitions(console: Console, cfg: SiteConfig, rows: list[PartitionTotals]) -> None:
    """The figures of each inbound partition over all its owners, and the site's sum (core/receivertotals.py):
    who wrote them, what that process did itself and what it took over from whom."""
    table = Table(title=f"gateway receivers of site {cfg.site}: figures per inbound partition, over every receiver "
                        "that owned it (carried with the partition: a receiver killed loses none)")
    for col in ("partition", "figures by", "taken over from", "batches", "duplicate batches", "rejected",
                "events applied", "of them recovered", "repeats discarded", "conflicts lost", "refused events",
                "own events applied"):
        table.add_column(col, justify="left" if col in ("figures by", "taken over from") else "right")
    for r in rows:
        t = r.totals
        table.add_row(str(r.partition), r.member or "—", r.carried_from or "—", str(t["batches"]),
                      str(t["duplicate_batches"]), str(t["rejected_batches"]), str(t["events_applied"]),
                      str(t["events_recovered"]), str(t["events_duplicate"]), str(t["conflicts"]),
                      str(t["exceptions"]), str(r.own["events_applied"]))
    site = summed(rows)
    table.add_row("site", "", "", str(site["batches"]), str(site["duplicate_batches"]), str(site["rejected_batches"]),
                  str(site["events_applied"]), str(site["events_recovered"]), str(site["events_duplicate"]),
                  str(site["conflicts"]), str(site["exceptions"]), "", style="bold", end_section=True)
    console.print(table)


def print_senders(console: Console, cfg: SiteConfig, reports: list[dict[str, Any]]) -> None:
    """The remote senders the running receivers heard from, and whether each is connected: a batch of it
    within receiver.max_time_between_pings_ms (no table when none was heard)."""
    merged: dict[tuple[int, str], dict[str, Any]] = {}
    for r in reports:
        if r["age_s"] >= 30:
            continue
        for sender in r.get("senders", ()):
            row = merged.setdefault((sender["source_dsid"], sender["sender_id"]),
                                    {"connected": False, "last_heard_at": 0, "batches": 0, "by": []})
            row["connected"] = row["connected"] or sender["connected"]
            row["last_heard_at"] = max(row["last_heard_at"], sender["last_heard_at"])
            row["batches"] += sender["batches"]
            row["by"].append(r["member"])
    if not merged:
        return
    ping_ms = cfg.receiver.max_time_between_pings_ms if cfg.receiver else 0
    table = Table(title=f"remote gateway senders heard by the receivers of site {cfg.site} (not connected: no batch "
                        f"for receiver.max_time_between_pings_ms={ping_ms})")
    for col in ("source dsid", "sender", "connection", "last batch (ago)", "batches", "heard by"):
        table.add_column(col, justify="right" if col in ("source dsid", "last batch (ago)", "batches") else "left")
    now_ms = time.time() * 1000
    for (dsid, sender_id), row in sorted(merged.items()):
        table.add_row(str(dsid), sender_id, "connected" if row["connected"] else "[yellow]not connected[/yellow]",
                      f"{(now_ms - row['last_heard_at']) / 1000:.1f}s", str(row["batches"]), ", ".join(row["by"]))
    console.print(table)


def print_json(cfg: SiteConfig) -> None:
    """``status --json``: the document the status page serves as /api/status, built the same way
    (statusdoc.py), without what only the page has (rates, history)."""
    from .statusdoc import document, sample

    sys.stdout.write(orjson.dumps(document(cfg, sample(cfg)), option=orjson.OPT_INDENT_2).decode() + "\n")


def steer_receiver(console: Console, cfg: SiteConfig, args: argparse.Namespace) -> int:
    """``start --receiver`` / ``stop --receiver``: the desired state of the site's gateway receiver processes,
    written to the control topic as a queue's is (core/control.py); they follow within a poll."""
    if args.command not in ("start", "stop"):
        print(f"sluice admin {args.command} --receiver: a gateway receiver is started or stopped (Geode's start and "
              "stop gateway-receiver), not paused or resumed", file=sys.stderr)
        return 2
    if args.queue:
        print(f"sluice admin {args.command} --receiver: takes no queue", file=sys.stderr)
        return 2
    if cfg.receiver is None:
        raise InvalidRequest("--receiver", cfg.site, "the site file has no receiver section")
    write_desired_state(cfg, RECEIVER_KIND, RECEIVER_ID, STATES[args.command], issued_by="sluice admin")
    console.print(f"gateway receiver of site {cfg.site}: {args.command} requested ({STATES[args.command]}); "
                  "its processes follow within a poll")
    return 0


def print_status(console: Console, cfg: SiteConfig, rows: list[PartitionStatus]) -> None:
    table = Table(title=f"queues of site {cfg.site} (dsid {cfg.dsid}): gateway senders and async event queues")
    for col, justify in (("queue", "left"), ("partition", "right"), ("primary", "left"), ("state", "left"),
                         ("queue size", "right"), ("oldest event", "right"), ("in flight", "right"),
                         ("last ack (ago)", "right"), ("batches", "right"), ("events", "right"),
                         ("resends", "right"), ("dead letters", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(r.queue_id, str(r.partition), r.primary, r.state, r.size_text,
                      "—" if r.oldest_age_s is None else f"{r.oldest_age_s:.1f}s", str(r.in_flight),
                      "—" if r.last_delivered_age_s is None else f"{r.last_delivered_age_s:.1f}s",
                      str(r.batches), str(r.events), str(r.redeliveries), str(r.dead_lettered))
    console.print(table)


@dataclass
class ClientStatus:
    client_id: str
    durable: bool
    connected: bool
    since_ms: int  # connected, or away, since
    primary: str
    queue_size: int | None
    oldest_age_s: float | None
    redundancy: int
    standbys: int  # live subscription instances besides the primary
    interest: str
    received: int
    repeats: int
    #: Why the subscription service dropped the client's queue (durable-client-timeout,
    #: maximum-message-count), until the client connects again; None for a registered client.
    dropped: str | None = None


def _interest_text(reg: dict[str, Any] | None) -> str:
    if reg is None:
        return "—"
    return ", ".join(
        f"{r['region']}:" + ("ALL_KEYS" if r["all_keys"] else f"/{r['regex']}/" if r["regex"] else
                             f"{len(r['keys'])} keys")
        + ("" if r["receive_values"] else " (invalidates)") + (" durable" if r["durable"] else "")
        for r in reg["interest"]) or "none"


def client_status(cfg: SiteConfig) -> list[ClientStatus]:
    """Every subscription client of the site: from the registry, the acks, the queues and the group."""
    codec = get_codec()
    names = cfg.topics
    partitions = cfg.subscriptions.registry_partitions
    consumer = make_consumer(cfg.kafka.client_settings(), None, **{"fetch.wait.max.ms": 50})
    now_ms = int(time.time() * 1000)
    try:
        with kafka_errors("reading the subscription clients"):
            tables: dict[str, dict[str, dict[str, Any]]] = {"ClientRegistration": {}, "ClientAck": {}}
            #: Clients whose queue the service dropped: (why, when, their last registration if still read).
            dropped: dict[str, tuple[str, int, dict[str, Any] | None]] = {}
            token = configured_token(cfg)
            checks = {"ClientRegistration": check_registration, "ClientAck": check_ack}
            for topic, schema in ((names.subscription_registry(), "ClientRegistration"),
                                  (names.subscription_acks(), "ClientAck")):
                for p in range(partitions):
                    for msg in read_to_end(consumer, topic, p):
                        # What the subscription service refuses (a forged or malformed record) is not shown
                        # either, and never names the queue this command then reads.
                        key = (msg.key() or b"").decode("utf-8", "replace")
                        try:
                            check_authorized(msg.headers(), token, "record")
                            if msg.value() is None:
                                last = tables[schema].pop(key, None)
                                reason = unregistered_reason(msg.headers()) if schema == "ClientRegistration" else None
                                if reason in QUEUE_DROPPED:
                                    dropped[key] = (reason, msg.timestamp()[1], last)
                                continue
                            record = codec.decode_as(schema, msg.value())
                            checks[schema](cfg, key, p, record)
                        except (CodecError, InvalidRequest):
                            continue
                        tables[schema][key] = record
                        if schema == "ClientRegistration":
                            dropped.pop(key, None)
            try:
                members = describe_group_members(make_admin(cfg.kafka.client_settings()),
                                                 f"{cfg.kafka.topic_prefix}subscriptions")
            except SluiceError:
                members = []
            owners = {p: member for member, tps in members for t, p in tps if t == names.subscription_registry()}
            standbys = max(0, len(members) - 1)
            rows = []
            for client_id, reg in sorted(tables["ClientRegistration"].items()):
                ack = tables["ClientAck"].get(client_id)
                head = ack["next_offset"] if ack is not None and ack["queue_topic"] == reg["queue_topic"] else 0
                size = oldest = None
                try:
                    with kafka_errors(f"reading {reg['queue_topic']}"):
                        low, high = consumer.get_watermark_offsets(TopicPartition(reg["queue_topic"], 0), timeout=5)
                        head = max(head, low)
                        size = max(0, high - head)
                        if size:
                            consumer.assign([TopicPartition(reg["queue_topic"], 0, head)])
                            msg = consumer.poll(5)
                            if msg is not None and msg.error() is None:
                                oldest = (now_ms - msg.timestamp()[1]) / 1000
                            consumer.unassign()
                except SluiceError:
                    pass  # the queue's size and age are not known now: shown as such
                heard = last_heard(reg, ack)
                connected = reg["connected"] and now_ms - heard <= cfg.subscriptions.maximum_time_between_pings_ms
                since = reg["changed_at"] if connected or not reg["connected"] else heard
                rows.append(ClientStatus(
                    client_id, reg["durable"], connected, since,
                    owners.get(registry_partition(client_id, partitions), "none"), size, oldest, reg["redundancy"],
                    standbys, _interest_text(reg), ack["received"] if ack else 0, ack["repeats"] if ack else 0))
            for client_id, (reason, at_ms, last) in sorted(dropped.items()):
                rows.append(ClientStatus(
                    client_id, last["durable"] if last else reason == DURABLE_CLIENT_TIMEOUT, False, at_ms,
                    owners.get(registry_partition(client_id, partitions), "none"), None, None,
                    last["redundancy"] if last else 0, standbys, _interest_text(last), 0, 0, dropped=reason))
            return rows
    finally:
        consumer.close()


def print_clients(console: Console, cfg: SiteConfig, rows: list[ClientStatus]) -> None:
    table = Table(title=f"subscription clients of site {cfg.site} (dsid {cfg.dsid})")
    for col in ("client", "durable", "connection", "primary", "queue size", "oldest message", "redundancy",
                "received", "repeats discarded", "interest"):
        table.add_column(col, justify="right" if col in ("queue size", "oldest message", "redundancy", "received",
                                                         "repeats discarded") else "left")
    now = time.time()
    for r in rows:
        ago = now - r.since_ms / 1000
        clock = time.strftime("%H:%M:%S", time.localtime(r.since_ms / 1000))
        connection = (f"queue dropped at {clock} ({r.dropped})" if r.dropped else
                      f"connected since {clock}" if r.connected else f"away since {clock} ({ago:.0f}s)")
        table.add_row(r.client_id, "yes" if r.durable else "no", connection, r.primary,
                      "—" if r.queue_size is None else str(r.queue_size),
                      "—" if r.oldest_age_s is None else f"{r.oldest_age_s:.1f}s",
                      f"{r.redundancy}" + (f" ({r.standbys} standby)" if r.standbys < r.redundancy else ""),
                      str(r.received), str(r.repeats), r.interest)
    if not rows:
        table.add_row("(none)", "", "", "", "", "", "", "", "", "")
    console.print(table)


@dataclass
class BucketStatus:
    """One bucket of a region: its owner and its standby copies, from the instances' directory records."""

    region: str
    bucket: int
    primary: str | None
    #: (instance, lag in changelog offsets (-1 not known yet), entries, value bytes) of each standby copy.
    standbys: list[tuple[str, int, int, int]]
    redundant_copies: int


def bucket_status(cfg: SiteConfig) -> list[BucketStatus]:
    """Every bucket of every region with redundant copies, as the live region-service instances' records say."""
    wanted = {r.name: r for r in cfg.regions if r.redundant_copies}
    if not wanted:
        return []
    instances = read_instances(cfg)
    owners = owners_of(instances, by_name=True)
    copies = {rb: [(inst.instance, lag, entries, size) for inst, lag, entries, size in found]
              for rb, found in standbys_of(instances).items()}
    return [BucketStatus(name, b, owners.get((name, b)), copies.get((name, b), []), region.redundant_copies)
            for name, region in wanted.items() for b in range(region.buckets)]


def print_buckets(console: Console, cfg: SiteConfig, rows: list[BucketStatus]) -> None:
    """One row per bucket of the regions with redundant copies (none: no table)."""
    if not rows:
        return
    table = Table(title=f"region buckets of site {cfg.site} with redundant copies: primary and standby copies "
                        "(lag in changelog offsets behind the partition's end)")
    for col in ("region", "bucket", "primary", "standby copies", "copies", "entries per copy", "value bytes held"):
        table.add_column(col, justify="left" if col in ("region", "primary", "standby copies") else "right")
    for r in rows:
        standbys = ", ".join(f"{name} (lag {'?' if lag < 0 else lag})" for name, lag, _, _ in r.standbys) or "none"
        short = len(r.standbys) < r.redundant_copies
        table.add_row(r.region, str(r.bucket), r.primary or "[red]none[/red]",
                      f"[yellow]{standbys}[/yellow]" if short else standbys,
                      f"{len(r.standbys)}/{r.redundant_copies}",
                      ", ".join(f"{n:,}" for _, _, n, _ in r.standbys) or "—",
                      f"{sum(size for _, _, _, size in r.standbys):,}")
    console.print(table)
